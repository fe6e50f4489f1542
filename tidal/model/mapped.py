"""Checkpoint files mapped into memory, so a weight can be a view of its bytes in the file.

Reading a weight into memory the process allocates costs a copy out of the page cache and the first
touch of every new page, which on a virtual machine is the slow part of a load (a fresh process
fills new memory at a fraction of the disk's rate). A weight whose bytes on disk are its bytes in
memory (same dtype: a whole tensor, a range of its rows, one stacked expert weight as a strided
view over the experts' runs, ``checkpoint.map_experts``, or each MXFP4 expert's codes and scales
wherever the file put them, ``checkpoint.map_packed_experts``) is instead a view of the file's
mapping: the load reads the file into the page
cache, as ``cat`` does, and maps those pages (``MADV_POPULATE_READ``), with no copy and no new
memory. This is llama.cpp's default (``--no-mmap`` turns it off there; ``use_mmap=False`` here).

The mapping is private and writable: a write to a weight copies that page for this process and
never reaches the file. Clean pages stay the page cache's, so a process under memory pressure may
drop them and read them back from the file later. The file must not be truncated or rewritten in
place while a model maps it (``save_model`` writes new files: it unlinks the old ones first).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux 5.14
PAGE = mmap.PAGESIZE


class MappedFiles:
    """Each file mapped once, on first use, for as long as a view of it lives (a view holds a
    reference to its mapping; nothing is unmapped while a weight uses it)."""

    def __init__(self) -> None:
        self.maps: dict[Path, mmap.mmap] = {}
        self.populate_works = True
        self._populating = threading.Lock()

    def view(self, path: Path, offset: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The ``nbytes`` at ``offset`` of ``path`` as a tensor of ``shape`` and ``dtype`` sharing the
        mapping's pages, or None where the bytes cannot back such a tensor (misaligned for the
        dtype, or the file too short)."""
        count = 1
        for s in shape:
            count *= s
        if count * dtype.itemsize != nbytes or offset % dtype.itemsize or nbytes == 0:
            return None
        m = self._map(path)
        if offset + nbytes > len(m):
            return None
        return torch.frombuffer(m, dtype=dtype, count=count, offset=offset).view(shape)

    def populate(self, t: torch.Tensor) -> torch.Tensor:
        """Read ``t``'s pages from the file and map them now (not at the first forward pass);
        returns ``t``. Where the kernel has no MADV_POPULATE_READ, asks for read-ahead instead."""
        self.populate_span(*extent(t))
        return t

    def populate_span(self, start: int, end: int) -> None:
        """:meth:`populate` of the mapped addresses [start, end)."""
        self.populate_ranges([(start, end)])

    def populate_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """:meth:`populate` of mapped address ranges [start, end), in file order: each range first
        asks for read-ahead (MADV_WILLNEED; the kernel starts a few MB of it, which a caller on
        another thread does while the ranges before are still being mapped), then their pages are
        mapped, one caller at a time."""
        ranges = [(start // PAGE * PAGE, end) for start, end in ranges]
        for start, end in ranges:
            _madvise(start, end - start, _MADV_WILLNEED)
        if not self.populate_works:
            return
        with self._populating:
            for start, end in ranges:
                if _madvise(start, end - start, _MADV_POPULATE_READ) != 0:
                    self.populate_works = False
                    return

    def _map(self, path: Path) -> mmap.mmap:
        m = self.maps.get(path)
        if m is None:
            fd = os.open(path, os.O_RDONLY)
            try:
                m = self.maps[path] = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_PRIVATE,
                                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        return m


_LIBC: ctypes.CDLL | None = None


def _madvise(start: int, length: int, advice: int) -> int:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)


def extent(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) addresses of the bytes view ``t`` spans (a strided view: from its first element
    to its last, the gaps between its rows included)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else -1
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


# Consecutive mapped weights are populated in jobs of at least this many bytes (progress is
# reported per job).
SPAN_BYTES = 64 << 20

Job = tuple[object, int, Callable[[], object]]


def coalesce(jobs: Iterable[tuple[str, int, Callable[[], torch.Tensor] | torch.Tensor]], mapped: MappedFiles
             ) -> Iterator[Job]:
    """The read jobs ``(name, nbytes, read)`` of a load (``tidal.model.readahead.read_ahead``) where
    jobs whose third item is a tensor (a view of ``mapped``: the pages of its :func:`extent` to
    populate) are gathered, as they come, into one job per SPAN_BYTES of views (a read job ends one
    early), keyed by the tuple of their names, whose result is the tuple of views. Views that follow
    one another in memory are one range: safetensors stores tensors back to back, so the views of a
    file in file order are a few long ranges, the pieces of a rank's slices a range each."""
    names: list[str] = []
    views: list[torch.Tensor] = []
    ranges: list[tuple[int, int]] = []
    held = 0

    def flush() -> Job:
        kept, spans, key = tuple(views), list(ranges), tuple(names)
        names.clear()
        views.clear()
        ranges.clear()

        def populate() -> tuple[torch.Tensor, ...]:
            mapped.populate_ranges(spans)
            return kept

        return key, 0, populate

    for name, nbytes, job in jobs:
        if not isinstance(job, torch.Tensor):
            if names:
                held = 0
                yield flush()
            yield name, nbytes, job
            continue
        lo, hi = extent(job)
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
        names.append(name)
        views.append(job)
        held += hi - lo
        if held >= SPAN_BYTES:
            held = 0
            yield flush()
    if names:
        yield flush()
