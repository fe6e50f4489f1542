"""Small C kernels for the CPU hot spots that torch cannot fuse, built on first use.

A kernel is compiled once with the system C compiler (``cc -O3 -march=native -fopenmp``) into
``$TIDAL_CACHE_DIR`` (default ``~/.cache/tidal/kernels``, keyed by a hash of the source and flags)
and called through ctypes on raw pointers. Where no compiler works, or ``TIDAL_CPU_KERNELS=0``,
:func:`kda_decode_kernel` returns None and the torch form runs instead (same math; the tests
compare the two). Sources live in ``tidal/ops/csrc``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger("tidal.kernels")

CSRC = Path(__file__).with_name("csrc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


def cache_dir() -> Path:
    return Path(os.environ.get("TIDAL_CACHE_DIR", Path.home() / ".cache" / "tidal")) / "kernels"


@cache
def _library(name: str) -> ctypes.CDLL | None:
    """Build (once) and load ``csrc/<name>.c``; None when disabled or the build fails."""
    if os.environ.get("TIDAL_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: the torch form of %s runs instead (slower)", name)
        return None
    source = (CSRC / f"{name}.c").read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([compiler, *FLAGS, str(CSRC / f"{name}.c"), "-o", str(built), "-lm"],
                               check=True, capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent builders never load a partial file
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("building the C kernel %s failed (%s %s): the torch form runs instead",
                       name, e, detail.decode(errors="replace")[-500:])
        return None


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


@cache
def kda_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """The C decode step (see csrc/kda_decode.c), or None where it is unavailable."""
    lib = _library("kda_decode")
    if lib is None:
        return None
    fn = lib.kda_decode_step_f32
    i64 = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, i64, *[ctypes.c_void_p] * 6, i64, i64, i64, i64, ctypes.c_int]
    fn.restype = None

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> torch.Tensor:
        B, H, K, V = state.shape
        q, k, v, g, beta = (t.to(torch.float32).contiguous() for t in (q, k, v, g, beta))
        o = torch.empty(B, H, V, dtype=torch.float32)
        fn(_ptr(state), state.stride(0), _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(o),
           B, H, K, V, torch.get_num_threads())
        return o

    return step


def kda_decode_for(state: torch.Tensor, *inputs: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The C decode step when it applies to this call: a float32 CPU state whose [H, K, V] blocks
    are contiguous, no input that autograd tracks, and the kernel built."""
    B, H, K, V = state.shape
    if (state.device.type != "cpu" or state.dtype != torch.float32 or B == 0 or max(K, V) > 4096
            or state.stride()[1:] != (K * V, V, 1) or state.requires_grad
            or any(t.requires_grad for t in inputs)):
        return None
    return kda_decode_kernel()
