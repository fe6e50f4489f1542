"""Environment switches read on hot paths.

Switches such as ``TIDAL_FUSED_DECODE`` are read at every call (tests and benchmarks flip them
between calls), a few hundred times in a batch-1 decode step. ``os.environ.get`` encodes the name
and decodes the value in Python each time; the mapping underneath it (``os.environ._data``, which
every write through ``os.environ`` updates) answers the same lookup in one dict probe.
"""

from __future__ import annotations

import os
from functools import cache

_RAW = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)


@cache
def _encoded(name: str):
    assert _ENCODE is not None
    return _ENCODE(name)


def getenv(name: str, default: str) -> str:
    """``os.environ.get(name, default)``, as it is at this call."""
    if _RAW is None or _ENCODE is None or _DECODE is None:  # another os.environ than CPython's
        return os.environ.get(name, default)
    raw = _RAW.get(_encoded(name))
    return default if raw is None else _DECODE(raw)
