"""Subnormal floats flushed to zero on the threads that run a CPU engine's steps (csrc/float_mode.c).

Decaying recurrent state makes subnormal floats (KDA's decay exp(G) over a chunk, products of two
small decayed factors), and on x86 every operation that reads or writes one takes a slow microcode
path: a chunked KDA prefill full of them ran several times slower. Flush-to-zero and
denormals-are-zero make such values 0; what they carry (below 1.2e-38) is nothing a model's output
shows, and oneDNN's bf16 tiles and dot products treat them so already.

The mode is per thread (MXCSR), and libgomp keeps a thread pool per thread that starts parallel
regions, so :func:`flush_denormals` sets the calling thread and its pool; threads created later
copy their creator's mode. The worker calls it before a step on a thread not yet set
(``TIDAL_FLUSH_DENORMALS=0``: never).
"""

from __future__ import annotations

import os

import torch

from tidal.ops.cpu_kernels import float_mode_kernels
from tidal.ops.switches import getenv


def flush_denormals(on: bool = True) -> bool:
    """Flush subnormals to zero (``on``) or keep IEEE subnormals on the calling thread and its
    OpenMP pool; whether the mode is now as asked (False where the CPU cannot flush)."""
    kernels = float_mode_kernels()
    if kernels is None:  # no C compiler: torch's switch, for the calling thread
        return torch.set_flush_denormal(on)
    # every thread the pool may hold: the regions to come may use more threads than this one
    return kernels[0](int(on), max(torch.get_num_threads(), os.cpu_count() or 1)) > 0


def flushing_denormals() -> bool:
    """Whether the calling thread flushes subnormals to zero."""
    kernels = float_mode_kernels()
    return kernels is not None and kernels[1]() == 1


def ensure_flushing() -> None:
    """:func:`flush_denormals` on a thread that does not flush yet (a cheap check per step);
    nothing under ``TIDAL_FLUSH_DENORMALS=0`` (IEEE subnormals kept)."""
    if getenv("TIDAL_FLUSH_DENORMALS", "1") != "0" and not flushing_denormals():
        flush_denormals(True)
