"""Sizes and counts on the command line with units, as vLLM and SGLang users write them:
``1GiB``, ``512MB``, ``4096`` (bytes), ``8k`` (tokens: k/m/g are powers of 1000, K/M/G of 1024)."""

from __future__ import annotations

import argparse
import re

_BYTES = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_COUNTS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def _parse(text: str, table: dict[str, int], fold: bool, what: str) -> int:
    m = _NUMBER.fullmatch(text)
    unit = (m.group(2).lower() if fold else m.group(2)) if m else None
    if m is None or unit not in table:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {what} (examples: {'1GiB, 512MB, 4096' if fold else '8192, 8k, 32K'})")
    return int(float(m.group(1)) * table[unit])


def parse_bytes(text: str) -> int:
    """``1GiB`` -> 1073741824, ``512MB`` -> 512000000, ``4096`` -> 4096."""
    return _parse(text, _BYTES, True, "size in bytes")


def parse_count(text: str) -> int:
    """``8k`` -> 8000, ``8K`` -> 8192, ``4096`` -> 4096 (vLLM's --max-model-len convention)."""
    return _parse(text, _COUNTS, False, "token count")
