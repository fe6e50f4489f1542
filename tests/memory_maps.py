"""Which address ranges of this process map given files (/proc/self/maps): tests that weights are
views of a checkpoint's mapping rather than copies."""

from __future__ import annotations


def mapped_ranges(files) -> list[tuple[int, int]]:
    """[lo, hi) address ranges of this process's mappings of ``files``."""
    names = {str(f) for f in files}
    ranges = []
    for line in open("/proc/self/maps"):
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].strip() in names:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((lo, hi))
    return ranges
