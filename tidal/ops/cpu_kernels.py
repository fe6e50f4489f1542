"""Small C kernels for the CPU hot spots that torch cannot fuse, built on first use.

A kernel is compiled once with the system C compiler (``cc -O3 -march=native -fopenmp``) into
``$TIDAL_CACHE_DIR`` (default ``~/.cache/tidal/kernels``, keyed by a hash of the source and flags)
and called through ctypes on raw pointers. Where the native build fails, or ``TIDAL_CPU_PORTABLE=1``,
the kernel is built without ``-march=native`` (the portable path: plain C, same results within
rounding). Where no compiler works, or ``TIDAL_CPU_KERNELS=0``, the ``*_kernel`` functions return
None and the torch form runs instead (same math; the tests compare the two). Sources live in
``tidal/ops/csrc``. Their OpenMP threads share torch's runtime, whose waits tidal makes passive
(``tidal/__init__.py``): on a shared CPU a spinning barrier multiplies the step time.

On CPUs with AMX-BF16 the bfloat16 rows' products take the tile path (``csrc/amx_tiles.h``) from
:data:`AMX_MIN_ROWS` rows, switched for every library at once through ``csrc/amx_state.c``:
``TIDAL_CPU_AMX=0`` turns it off, ``TIDAL_CPU_AMX=<n>`` (n > 1) sets the threshold, and
deterministic inference turns it off on its thread (:func:`amx_thread_off`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Callable, Iterator

import torch

from tidal.ops.mxfp4_table import ExpertTable
from tidal.ops.switches import getenv

logger = logging.getLogger("tidal.kernels")

CSRC = Path(__file__).with_name("csrc")
PORTABLE_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
FLAGS = [*PORTABLE_FLAGS[:1], "-march=native", *PORTABLE_FLAGS[1:]]


# The other sources a library is linked from beside csrc/<name>.c: a kernel that calls other kernels'
# code (each its own translation unit, so their register tiles of different weight types coexist).
LIBRARY_SOURCES: dict[str, tuple[str, ...]] = {
    "moe_layer_decode": ("moe_router", "mxfp4_gemm", "mlp_decode", "rms_norm"),
    "mla_layer_decode": ("mla_decode", "rms_norm"),
    "attn_res": ("rms_norm",),
    "model_decode": ("attn_res", "rms_norm", "kda_layer_decode", "mla_layer_decode", "mla_decode", "moe_layer_decode",
                     "moe_router", "mxfp4_gemm", "mlp_decode"),
}


# Rows from which a bfloat16 product takes the AMX tiles (benchmarks/bench_amx_tiles.py).
AMX_MIN_ROWS = 8


def amx_rows_setting() -> int:
    """``TIDAL_CPU_AMX``: 0 off, 1 (the default) :data:`AMX_MIN_ROWS`, n > 1 from n rows."""
    rows = int(os.environ.get("TIDAL_CPU_AMX", "1"))
    return AMX_MIN_ROWS if rows == 1 else max(rows, 0)


def cache_dir() -> Path:
    return Path(os.environ.get("TIDAL_CACHE_DIR", Path.home() / ".cache" / "tidal")) / "kernels"


def portable_only() -> bool:
    """``TIDAL_CPU_PORTABLE=1``: build every kernel without ``-march=native``."""
    return os.environ.get("TIDAL_CPU_PORTABLE", "0") == "1"


@cache
def _library(name: str) -> ctypes.CDLL | None:
    """Build (once) and load ``csrc/<name>.c``, native first, then portable; None when disabled or
    both builds fail."""
    if os.environ.get("TIDAL_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: the torch form of %s runs instead (slower)", name)
        return None
    for flags in ([PORTABLE_FLAGS] if portable_only() else [FLAGS, PORTABLE_FLAGS]):
        lib = _build(compiler, name, flags)
        if lib is not None:
            _bind_amx(lib)
            return lib
    return None


@cache
def _amx_state() -> ctypes.CDLL | None:
    """csrc/amx_state.c (the tile path's switch), set from ``TIDAL_CPU_AMX``; None without kernels."""
    lib = _library("amx_state")
    if lib is not None:
        lib.tidal_amx_set_rows.argtypes, lib.tidal_amx_set_rows.restype = [ctypes.c_int], ctypes.c_int
        lib.tidal_amx_thread_off.argtypes, lib.tidal_amx_thread_off.restype = [ctypes.c_int], None
        lib.tidal_amx_least_rows.argtypes, lib.tidal_amx_least_rows.restype = [], ctypes.c_int
        lib.tidal_amx_set_rows(amx_rows_setting())
    return lib


def _bind_amx(lib: ctypes.CDLL) -> None:
    """A library built with the tile path (it exports ``tidal_amx_bind``) reads the one switch."""
    bind = getattr(lib, "tidal_amx_bind", None)
    state = _amx_state() if bind is not None else None
    if state is not None:
        bind.argtypes, bind.restype = [ctypes.c_void_p], None
        bind(ctypes.cast(state.tidal_amx_rows, ctypes.c_void_p))


def set_amx_rows(rows: int) -> int:
    """Set the tile path's threshold for the process (0: off); returns the one in force (0 where
    the kernels are off or Linux refuses the tiles). Benchmarks and tests flip it between calls."""
    state = _amx_state()
    return 0 if state is None else state.tidal_amx_set_rows(rows)


@contextmanager
def amx_rows(rows: int) -> Iterator[int]:
    """The block with the tile path's threshold at ``rows`` (0: off; 1: every row count, whose bits
    are then row-invariant as the FMA tiles' are), yielding the one in force (0 where the kernels
    were built without the tiles: a portable build, another CPU); the one before after."""
    state = _amx_state()
    before = 0 if state is None else state.tidal_amx_least_rows()
    built = hasattr(_library("bf16_gemm") or object(), "tidal_amx_bind")
    try:
        yield set_amx_rows(rows) if built else 0
    finally:
        set_amx_rows(before)


def amx_thread_off(off: bool) -> None:
    """Keep the calling thread's products off the tile path (``off``) or let them take it:
    deterministic inference holds every product to the FMA tiles' row-invariant order."""
    state = _amx_state()
    if state is not None:
        state.tidal_amx_thread_off(int(off))


def _build(compiler: str, name: str, flags: list[str]) -> ctypes.CDLL | None:
    sources = [CSRC / f"{n}.c" for n in (name, *LIBRARY_SOURCES.get(name, ()))]
    # the shared headers belong to every kernel's source (a changed tile rebuilds its users)
    source = b"".join(p.read_bytes() for p in [*sources, *sorted(CSRC.glob("*.h"))])
    # -march=native: the CPU's features belong in the key (a shared home directory, another CPU).
    key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_features()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([compiler, *flags, *map(str, sources), "-o", str(built), "-lm"],
                               check=True, capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent builders never load a partial file
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("building the C kernel %s with %s failed (%s %s)", name, " ".join(flags), e,
                       detail.decode(errors="replace")[-500:])
        return None


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.machine() + platform.processor()


def _ptr(t: torch.Tensor) -> int:
    """The address a ``c_void_p`` argument takes (as an int: ctypes converts it without an object)."""
    return t.data_ptr()


def _function(library: str, name: str, argtypes: list) -> Callable | None:
    lib = _library(library)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, None
    return fn


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@cache
def kda_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """The C decode step (see csrc/kda_decode.c), or None where it is unavailable."""
    fn = _function("kda_decode", "kda_decode_step_f32", [_PTR, _I64, *[_PTR] * 6, *[_I64] * 4, ctypes.c_int])
    if fn is None:
        return None

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


@cache
def mla_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """The C paged MLA decode attention (see csrc/mla_decode.c), or None where it is unavailable."""
    fn = _function("mla_decode", "mla_paged_decode",
                   [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, *[_I64] * 4, ctypes.c_float, ctypes.c_int,
                    ctypes.c_int])
    if fn is None:
        return None

    def attend(pages: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, query: torch.Tensor,
               rank: int, scale: float) -> torch.Tensor:
        B, n, C = query.shape
        table, lengths = table.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
        query = query.to(torch.float32).contiguous()
        o_lat = torch.empty(B, n, rank, dtype=torch.float32)
        fn(_ptr(pages), pages.stride(0), pages.shape[1], _ptr(table), table.shape[1], _ptr(lengths), _ptr(query),
           _ptr(o_lat), B, n, C, rank, scale, int(pages.dtype == torch.bfloat16), torch.get_num_threads())
        return o_lat

    return attend


def mla_decode_for(pages: torch.Tensor, query: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The C paged decode attention when it applies: CPU pages [P, page_size, C] of float32 or
    bfloat16 rows (each page's rows contiguous), no autograd, and the kernel built."""
    if (pages.device.type != "cpu" or pages.dtype not in (torch.float32, torch.bfloat16) or pages.dim() != 3
            or pages.stride()[1:] != (pages.shape[2], 1) or query.requires_grad or query.shape[-1] != pages.shape[2]):
        return None
    return mla_decode_kernel()


@cache
def mla_absorbed_kernel() -> Callable[..., torch.Tensor] | None:
    """csrc/mla_decode.c's ``mla_absorbed_decode``: the whole absorbed decode (query absorption, paged
    attention, output absorption) with kv_b_proj's weight read in place, or None."""
    fn = _function("mla_decode", "mla_absorbed_decode",
                   [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, ctypes.c_int, _PTR, ctypes.c_int, _PTR,
                    ctypes.c_int, *[_I64] * 6, ctypes.c_float, ctypes.c_int, ctypes.c_int])
    if fn is None:
        return None
    fn.restype = ctypes.c_int

    def decode(q_nope: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, table: torch.Tensor,
               lengths: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
        B, n, dn = q_nope.shape
        r = w.shape[1]
        dv = w.shape[0] // n - dn
        table, lengths = table.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
        strides = torch.tensor([q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1)])
        out = torch.empty(B, n, dv, dtype=q_nope.dtype)
        bf16 = torch.bfloat16
        if fn(_ptr(pages), pages.stride(0), pages.shape[1], _ptr(table), table.shape[1], _ptr(lengths), _ptr(q_nope),
              _ptr(q_pe), _ptr(strides), _ptr(strides[2:]), int(q_nope.dtype == bf16), _ptr(w), int(w.dtype == bf16),
              _ptr(out), int(out.dtype == bf16), B, n, dn, dv, pages.shape[2], r, scale, int(pages.dtype == bf16),
              torch.get_num_threads()) != 0:
            raise MemoryError(f"mla_absorbed_decode: no scratch memory for {B} sequences")
        return out

    return decode


def mla_absorbed_for(pages: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                     w: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The C absorbed decode when it applies: CPU pages [P, page_size, r + d_rope] of float32 or
    bfloat16 rows (each page's rows contiguous), queries [B, n, d] of one of those dtypes with a
    contiguous last dim, a contiguous kv_b weight [n (d_nope + d_v), r] of float32 or bfloat16, no
    autograd, and the fused decode kernels on (``TIDAL_FUSED_DECODE``)."""
    dtypes = (torch.float32, torch.bfloat16)
    tensors = (pages, q_nope, q_pe, w)
    if (not fused_decode_enabled() or any(t.device.type != "cpu" or t.dtype not in dtypes for t in tensors)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return None
    n, dn = q_nope.shape[1], q_nope.shape[2]
    if (pages.dim() != 3 or pages.stride()[1:] != (pages.shape[2], 1) or q_nope.dim() != 3 or q_pe.dim() != 3
            or q_pe.dtype != q_nope.dtype or q_nope.stride(2) != 1 or q_pe.stride(2) != 1 or w.dim() != 2
            or not w.is_contiguous() or w.shape[0] % n or w.shape[0] // n <= dn
            or pages.shape[2] != w.shape[1] + q_pe.shape[2]):
        return None
    return mla_absorbed_kernel()


@cache
def grouped_gemm_kernel() -> Callable[..., torch.Tensor] | None:
    """The C grouped few-rows matmul (see csrc/grouped_gemm.c), or None where it is unavailable."""
    fn = _function("grouped_gemm", "grouped_rows_gemm",
                   [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, ctypes.c_int])
    if fn is None:
        return None

    def gemm(x: torch.Tensor, offsets: torch.Tensor, experts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32)
        fn(_ptr(x), x.shape[1], _ptr(offsets), _ptr(experts), experts.shape[0], _ptr(w), w.stride(0), w.shape[1],
           _ptr(out), torch.get_num_threads())
        return out

    return gemm


def grouped_gemm_for(x: torch.Tensor, *weights: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The C grouped matmul when it applies: float32 CPU rows and stacked [E, N, K] weights whose
    matrices have contiguous rows, and no autograd."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights)):
        return None
    for w in weights:
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 3 or w.stride()[1:] != (w.shape[2], 1):
            return None
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return grouped_gemm_kernel()


@cache
def mxfp4_kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    """(grouped matmul, dequantise) straight from packed MXFP4 experts (see csrc/mxfp4_gemm.c), or
    None where they are unavailable. The matmul takes the experts as an
    :class:`~tidal.ops.mxfp4_table.ExpertTable`, or stacked as (packed, scales)."""
    gemm_fn = _function("mxfp4_gemm", "mxfp4_grouped_gemm",
                        [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, ctypes.c_int,
                         ctypes.c_int])
    deq_fn = _function("mxfp4_gemm", "mxfp4_dequantize", [_PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, ctypes.c_int])
    if gemm_fn is None or deq_fn is None:
        return None
    gemm_fn.restype = ctypes.c_int

    def gemm(x: torch.Tensor, offsets: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor | ExpertTable,
             scales: torch.Tensor | None = None) -> torch.Tensor:
        table = packed if isinstance(packed, ExpertTable) else ExpertTable.stacked(packed, scales)
        bf16 = int(x.dtype == torch.bfloat16)  # bfloat16 values: groups of a few rows take the AMX tiles
        x = x.to(torch.float32).contiguous()
        N = table.rows
        out = torch.empty(x.shape[0], N, dtype=torch.float32)
        if gemm_fn(_ptr(x), x.shape[1], _ptr(offsets), _ptr(experts), experts.shape[0], _ptr(table.packed),
                   _ptr(table.scales), table.parts, table.packed_stride, table.scale_stride, N, _ptr(out), bf16,
                   torch.get_num_threads()) != 0:
            raise MemoryError(f"mxfp4_grouped_gemm: no scratch memory for {x.shape[0]} x {x.shape[1]} rows")
        return out

    def dequantize(experts: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        N, K = packed.shape[1], packed.shape[2] * 2
        out = torch.empty(experts.shape[0], N, K, dtype=torch.float32)
        deq_fn(_ptr(experts), experts.shape[0], _ptr(packed), _ptr(scales), N, K, _ptr(out), torch.get_num_threads())
        return out

    return gemm, dequantize


@cache
def mxfp4_dequantize_bf16_kernel() -> Callable[[ExpertTable, int], torch.Tensor] | None:
    """Expert e of an :class:`ExpertTable` as bfloat16 [N, K], exactly (csrc/mxfp4_gemm.c's
    ``mxfp4_dequantize_bf16``), or None."""
    fn = _function("mxfp4_gemm", "mxfp4_dequantize_bf16",
                   [_I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, ctypes.c_int])
    if fn is None:
        return None
    fn.restype = ctypes.c_int

    def dequantize(table: ExpertTable, e: int) -> torch.Tensor:
        out = torch.empty(table.rows, table.cols, dtype=torch.bfloat16)
        if fn(e, _ptr(table.packed), _ptr(table.scales), table.parts, table.packed_stride, table.scale_stride,
              table.rows, table.cols, _ptr(out), torch.get_num_threads()) != 0:
            raise ValueError(f"mxfp4_dequantize_bf16: {table.rows} rows in {table.parts} parts")
        return out

    return dequantize


@cache
def float_mode_kernels() -> tuple[Callable[[int, int], int], Callable[[], int]] | None:
    """csrc/float_mode.c's (set flush-to-zero on the caller and its OpenMP pool, read the caller's
    mode), or None."""
    set_fn = _function("float_mode", "tidal_flush_denormals", [ctypes.c_int, ctypes.c_int])
    get_fn = _function("float_mode", "tidal_flushing_denormals", [])
    if set_fn is None or get_fn is None:
        return None
    set_fn.restype = get_fn.restype = ctypes.c_int
    return set_fn, get_fn


@cache
def mxfp4_moe_kernel() -> Callable | None:
    """csrc/mxfp4_gemm.c's ``mxfp4_moe_tokens`` (a whole packed routed-expert sum), or None."""
    fn = _function("mxfp4_gemm", "mxfp4_moe_tokens",
                   [_PTR, _I64, ctypes.c_int, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
                    _PTR, _PTR, _I64, _I64, ctypes.c_int, ctypes.c_float, ctypes.c_float, _PTR, ctypes.c_int])
    if fn is not None:
        fn.restype = ctypes.c_int
    return fn


@cache
def bf16_gemm_kernel() -> Callable[..., torch.Tensor] | None:
    """The C float32-rows x bfloat16-weight product (see csrc/bf16_gemm.c), or None."""
    fn = _function("bf16_gemm", "bf16_gemm", [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, ctypes.c_int])
    if fn is None:
        return None

    def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        (M, K), N = x.shape, w.shape[0]
        out = torch.empty(M, N, dtype=torch.float32)
        fn(x.data_ptr(), M, K, w.data_ptr(), w.stride(0), N, out.data_ptr(), torch.get_num_threads())
        return out

    return gemm


class WeightParts:
    """Weights side by side as :func:`bf16_parts_kernel` takes them: the tensors and the arrays of
    their addresses, row strides and row counts (built once where a module keeps it, e.g. through
    ``tidal.model.layers.derived_weight``, instead of at every call)."""

    def __init__(self, weights: tuple[torch.Tensor, ...]) -> None:
        n = len(weights)
        self.weights = weights
        self.ptrs = (ctypes.c_void_p * n)(*(w.data_ptr() for w in weights))
        self.strides = (ctypes.c_int64 * n)(*(w.stride(0) for w in weights))
        self.rows = (ctypes.c_int64 * n)(*(w.shape[0] for w in weights))
        self.total = sum(w.shape[0] for w in weights)


@cache
def bf16_values_kernel() -> Callable[..., torch.Tensor] | None:
    """csrc/bf16_gemm.c's ``bf16_gemm_values_parts``: float32 rows whose values are bfloat16 ones
    times bfloat16 weights side by side, float32 out, the products the fused layer steps make (the
    AMX tiles from their threshold, like :func:`bf16_rows_kernel`'s sums); or None."""
    fn = _function("bf16_gemm", "bf16_gemm_values_parts",
                   [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_int])
    if fn is None:
        return None
    fn.restype = ctypes.c_int

    def gemm(x: torch.Tensor, ws: "list[torch.Tensor] | WeightParts") -> torch.Tensor:
        arrays = ws if isinstance(ws, WeightParts) else WeightParts(tuple(ws))
        x = x.to(torch.float32).contiguous()
        out = torch.empty(x.shape[0], arrays.total, dtype=torch.float32)
        if fn(_ptr(x), x.shape[0], x.shape[1], len(arrays.weights), arrays.ptrs, arrays.strides, arrays.rows, _ptr(out),
              torch.get_num_threads()) != 0:
            raise ValueError(f"bf16_gemm_values_parts: {len(arrays.weights)} parts (at most 8)")
        return out

    return gemm


@cache
def bf16_parts_kernel() -> Callable[..., torch.Tensor] | None:
    """x times several bfloat16 weights side by side (csrc/bf16_gemm.c's ``bf16_gemm_parts``, or for
    bfloat16 rows ``bf16_gemm_bf16_parts``): ``gemm(x, ws)`` -> [M, sum of the ws' rows], the bits of
    :func:`bf16_gemm_kernel` (float32 rows; bfloat16 rows: :func:`bf16_rows_kernel`) on the rows'
    concatenation, without making it; None where the kernel is unavailable."""
    f32 = _function("bf16_gemm", "bf16_gemm_parts", [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_int])
    b16 = _function("bf16_gemm", "bf16_gemm_bf16_parts",
                    [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_int])
    if f32 is None or b16 is None:
        return None
    f32.restype = b16.restype = ctypes.c_int

    def gemm(x: torch.Tensor, ws: "list[torch.Tensor] | WeightParts") -> torch.Tensor:
        arrays = ws if isinstance(ws, WeightParts) else WeightParts(tuple(ws))
        parts, ptrs, strides, ns = len(arrays.weights), arrays.ptrs, arrays.strides, arrays.rows
        if x.dtype == torch.bfloat16:
            x = x if x.stride(1) == 1 else x.contiguous()
            out = torch.empty(x.shape[0], arrays.total, dtype=torch.bfloat16)
            status = b16(_ptr(x), x.stride(0), x.shape[0], x.shape[1], parts, ptrs, strides, ns, _ptr(out),
                         torch.get_num_threads())
        else:
            x = x.to(torch.float32).contiguous()
            out = torch.empty(x.shape[0], arrays.total, dtype=torch.float32)
            status = f32(_ptr(x), x.shape[0], x.shape[1], parts, ptrs, strides, ns, _ptr(out), torch.get_num_threads())
        if status != 0:
            raise ValueError(f"bf16_gemm_parts: {parts} parts (at most 8) or no scratch memory for {x.shape[0]} rows")
        return out

    return gemm


def fused_decode_enabled() -> bool:
    """``TIDAL_FUSED_DECODE=0`` turns off the fused small-op kernels (RMSNorm, Block AttnRes, the KDA
    layer step: ``tidal.ops.fused_decode``), leaving the torch ops of ``tidal/model``; read at every
    call, so a benchmark can flip it between steps."""
    return getenv("TIDAL_FUSED_DECODE", "1") != "0"


@cache
def rms_norm_kernel() -> Callable | None:
    """csrc/rms_norm.c's ``rms_norm_rows``, or None where it is unavailable."""
    return _function("rms_norm", "rms_norm_rows",
                     [_PTR, _I64, _PTR, _I64, _PTR, ctypes.c_int, _I64, _I64, ctypes.c_float, ctypes.c_int,
                      ctypes.c_int])


@cache
def attn_res_kernels() -> tuple[Callable, Callable] | None:
    """(csrc/attn_res.c's ``attn_res_rows``, ``attn_res_inv_rms``), or None."""
    rows = _function("attn_res", "attn_res_rows",
                     [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_int, _PTR, ctypes.c_int])
    inv = _function("attn_res", "attn_res_inv_rms", [_PTR, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int, _PTR])
    return None if rows is None or inv is None else (rows, inv)


@cache
def attn_res_glue_kernel() -> Callable | None:
    """csrc/attn_res.c's ``attn_res_glue`` (residual add, AttnRes and RMSNorm in one call), or None."""
    fn = _function("attn_res", "attn_res_glue",
                   [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, ctypes.c_float, _PTR, _PTR,
                    ctypes.c_int, ctypes.c_float, _PTR, _I64, _I64, ctypes.c_int, ctypes.c_int])
    if fn is not None:
        fn.restype = ctypes.c_int
    return fn


@cache
def argmax_rows_kernel() -> Callable | None:
    """csrc/argmax_rows.c's ``argmax_rows`` (torch.argmax(dim=-1) of float32 rows), or None."""
    return _function("argmax_rows", "argmax_rows", [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_int])


@cache
def bf16_rows_kernel() -> Callable[..., torch.Tensor] | None:
    """The same product for bfloat16 rows, in and out (csrc/bf16_gemm.c's ``bf16_gemm_bf16``): the
    bits of :func:`bf16_gemm_kernel` followed by ``.to(torch.bfloat16)``, without the two casts."""
    fn = _function("bf16_gemm", "bf16_gemm_bf16", [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, ctypes.c_int])
    if fn is None:
        return None
    fn.restype = ctypes.c_int

    def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        stride, one = x.stride()
        if one != 1:
            x = x.contiguous()
            stride = x.stride(0)
        (M, K), N = x.shape, w.shape[0]
        out = torch.empty(M, N, dtype=torch.bfloat16)
        if fn(x.data_ptr(), stride, M, K, w.data_ptr(), w.stride(0), N, out.data_ptr(), torch.get_num_threads()) != 0:
            raise MemoryError(f"bf16_gemm: no scratch memory for {M} x {K} rows")
        return out

    return gemm


@cache
def activation_kernel() -> Callable | None:
    """csrc/activation.c's ``gated_activation`` (SiTU / SwiGLU of rows), or None."""
    return _function("activation", "gated_activation",
                     [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, ctypes.c_int, ctypes.c_float, ctypes.c_float,
                      ctypes.c_int, ctypes.c_int])


@cache
def sigmoid_gate_kernel() -> Callable | None:
    """csrc/activation.c's ``sigmoid_gate_rows`` (o * sigmoid(g) of rows: the MLA output gate), or None."""
    return _function("activation", "sigmoid_gate_rows",
                     [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, ctypes.c_int, ctypes.c_int])


@cache
def kda_layer_decode_kernel() -> Callable | None:
    """csrc/kda_layer_decode.c's ``kda_layer_decode``, or None."""
    return _function("kda_layer_decode", "kda_layer_decode",
                     [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, ctypes.c_int, _PTR, _I64, ctypes.c_int, _PTR,
                      _I64, _PTR, _PTR, _PTR, ctypes.c_int, _PTR, ctypes.c_float, ctypes.c_int, _PTR, ctypes.c_float,
                      _PTR, _I64, _I64, _I64, _I64, ctypes.c_int])


class KdaLayerWeights(ctypes.Structure):
    """csrc/kda_layer_decode.c's ``struct kda_layer_weights``: a bfloat16 KDA layer's weights by
    address (the six input projections q, k, v, f_a, output gate, b; f_b, g_b, o_proj; the float32
    conv weight, A_log, dt_bias, output-norm weight) and its sizes."""

    _fields_ = [
        ("hidden", _I64), ("heads", _I64), ("head_dim", _I64), ("conv_kernel", _I64), ("gate_rank", _I64),
        ("in_w", _PTR * 6), ("in_stride", _I64 * 6), ("in_rows", _I64 * 6),
        ("f_b_w", _PTR), ("g_b_w", _PTR), ("o_w", _PTR), ("f_b_stride", _I64), ("g_b_stride", _I64),
        ("o_stride", _I64), ("conv_w", _PTR), ("A_log", _PTR), ("dt_bias", _PTR), ("o_norm_w", _PTR),
        ("a_per_head", _I64), ("has_lb", _I64), ("lower_bound", ctypes.c_float), ("eps", ctypes.c_float),
    ]


@cache
def kda_layer_step_kernels() -> tuple[Callable, Callable] | None:
    """(csrc/kda_layer_decode.c's ``kda_layer_step``, ``kda_layer_step_scratch``), or None."""
    return _step_kernels("kda_layer_decode", "kda_layer_step", KdaLayerWeights,
                         [_PTR, _I64, _I64, _PTR, _I64, ctypes.c_int, _PTR, _I64, _PTR, _PTR, _PTR, ctypes.c_int])


def _step_kernels(library: str, step: str, weights: type[ctypes.Structure],
                  argtypes: list) -> tuple[Callable, Callable] | None:
    """(``step``, ``<step>_scratch``) of a one-call layer step that takes its layer's ``weights``
    structure first (then ``argtypes``) and returns a status, the scratch its scratch size; or None."""
    fn = _function(library, step, [ctypes.POINTER(weights), *argtypes])
    scratch = _function(library, f"{step}_scratch", [ctypes.POINTER(weights)])
    if fn is None or scratch is None:
        return None
    fn.restype, scratch.restype = ctypes.c_int, _I64
    return fn, scratch


class MlpWeights(ctypes.Structure):
    """csrc/mlp_decode.c's ``struct mlp_weights``: a bfloat16 gated MLP's gate, up and down weights by
    address, its sizes and its activation (kind 1 SiTU with its betas, 0 SwiGLU)."""

    _fields_ = [
        ("hidden", _I64), ("inter", _I64), ("gate_up", _PTR * 2), ("gate_up_stride", _I64 * 2),
        ("gate_up_rows", _I64 * 2), ("down", _PTR), ("down_stride", _I64), ("kind", _I64),
        ("beta", ctypes.c_float), ("linear_beta", ctypes.c_float),
    ]


@cache
def mlp_step_kernels() -> tuple[Callable, Callable] | None:
    """(csrc/mlp_decode.c's ``mlp_step``, ``mlp_step_scratch``), or None."""
    return _step_kernels("mlp_decode", "mlp_step", MlpWeights, [_PTR, _I64, _I64, _PTR, _PTR, ctypes.c_int])


@cache
def kda_layer_chain_kernel() -> Callable | None:
    """csrc/kda_layer_decode.c's ``kda_layer_chain`` (verified chains with the decode step's code), or None."""
    return _function("kda_layer_decode", "kda_layer_chain",
                     [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, ctypes.c_int, _PTR, _I64, ctypes.c_int, _PTR,
                      _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, ctypes.c_int, _PTR, ctypes.c_float, ctypes.c_int,
                      _PTR, ctypes.c_float, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int])


@cache
def moe_router_kernel() -> Callable | None:
    """csrc/moe_router.c's ``moe_router_topk`` (scores, bias-corrected grouped top-k, weights), or None."""
    fn = _function("moe_router", "moe_router_topk",
                   [_PTR, _I64, ctypes.c_int, _I64, _I64, _PTR, ctypes.c_int, _I64, _PTR, _I64, _I64, _I64,
                    ctypes.c_int, ctypes.c_float, _PTR, _PTR, ctypes.c_int])
    if fn is not None:
        fn.restype = ctypes.c_int
    return fn


class MoeLayerWeights(ctypes.Structure):
    """csrc/moe_layer_decode.c's ``struct moe_layer_weights``: a bfloat16 MoE layer with packed MXFP4
    routed experts by address (the router, K3's latent projections and norm, the experts' tables,
    the shared expert as an :class:`MlpWeights`) and its sizes."""

    _fields_ = [
        ("hidden", _I64), ("expert_hidden", _I64), ("num_experts", _I64), ("top_k", _I64), ("n_group", _I64),
        ("topk_group", _I64), ("renormalize", _I64), ("routed_scale", ctypes.c_float),
        ("router_w", _PTR), ("router_bf16", _I64), ("router_bias", _PTR),
        ("down_w", _PTR), ("up_w", _PTR), ("down_stride", _I64), ("up_stride", _I64),
        ("norm_w", _PTR), ("norm_bf16", _I64), ("norm_eps", ctypes.c_float),
        ("w13", _PTR), ("w13_scales", _PTR), ("w13_parts", _I64), ("w13_stride", _I64), ("w13_scale_stride", _I64),
        ("inter", _I64), ("w2", _PTR), ("w2_scales", _PTR), ("w2_stride", _I64), ("w2_scale_stride", _I64),
        ("act_kind", _I64), ("beta", ctypes.c_float), ("linear_beta", ctypes.c_float),
        ("shared", ctypes.POINTER(MlpWeights)),
    ]


@cache
def moe_layer_step_kernels() -> tuple[Callable, Callable] | None:
    """(csrc/moe_layer_decode.c's ``moe_layer_step``, ``moe_layer_step_scratch``), or None."""
    return _step_kernels("moe_layer_decode", "moe_layer_step", MoeLayerWeights,
                         [_PTR, _I64, _I64, _PTR, _PTR, ctypes.c_int])


@cache
def markov_draft_kernel() -> Callable | None:
    """csrc/markov_draft.c's ``markov_draft`` (the DSPARK drafter's slot loop), or None."""
    fn = _function("markov_draft", "markov_draft",
                   [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, ctypes.c_float, _PTR, _PTR, ctypes.c_int])
    if fn is not None:
        fn.restype = ctypes.c_int
    return fn


class MlaLayerWeights(ctypes.Structure):
    """csrc/mla_layer_decode.c's ``struct mla_layer_weights``: a bfloat16 MLA layer's weights by
    address (the input projections q_a or q, kv_a and the output gate's; q_b, kv_b, o; the two norms'
    weights) and its sizes."""

    _fields_ = [
        ("hidden", _I64), ("heads", _I64), ("q_rank", _I64), ("kv_rank", _I64), ("nope", _I64), ("rope", _I64),
        ("v_dim", _I64), ("gated", _I64), ("in_w", _PTR * 3), ("in_stride", _I64 * 3), ("in_rows", _I64 * 3),
        ("q_b_w", _PTR), ("q_b_stride", _I64), ("q_norm_w", _PTR), ("kv_norm_w", _PTR), ("q_norm_bf16", _I64),
        ("kv_norm_bf16", _I64), ("q_eps", ctypes.c_float), ("kv_eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("kv_b_w", _PTR), ("o_w", _PTR), ("o_stride", _I64),
    ]


@cache
def mla_layer_step_kernel() -> Callable | None:
    """csrc/mla_layer_decode.c's ``mla_layer_step``, or None."""
    fn = _function("mla_layer_decode", "mla_layer_step",
                   [ctypes.POINTER(MlaLayerWeights), _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR,
                    _PTR, ctypes.c_int])
    if fn is not None:
        fn.restype = ctypes.c_int
    return fn


class GlueWeights(ctypes.Structure):
    """csrc/model_decode.c's ``struct glue_weights``: an AttnRes pseudo-query and the next norm."""

    _fields_ = [("query", _PTR), ("norm_w", _PTR), ("norm_bf16", _I64), ("norm_eps", ctypes.c_float)]


class DecodeLayer(ctypes.Structure):
    """csrc/model_decode.c's ``struct decode_layer``: one decoder layer's step weights, its AttnRes
    glue, and its share of the pool's storage."""

    _fields_ = [("attn_kind", _I64), ("attn_w", _PTR), ("attn_scratch", _PTR), ("conv_state", _PTR),
                ("conv_stride", _I64), ("conv_bf16", _I64), ("rec_state", _PTR), ("rec_stride", _I64),
                ("pages", _PTR), ("page_stride", _I64), ("page_size", _I64), ("ffn_kind", _I64), ("ffn_w", _PTR),
                ("ffn_scratch", _PTR), ("attn_glue", GlueWeights), ("ffn_glue", GlueWeights)]


class DecodeProgram(ctypes.Structure):
    """csrc/model_decode.c's ``struct decode_program``: a model's decode step."""

    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("block_size", _I64), ("eps", ctypes.c_float),
                ("layers", ctypes.POINTER(DecodeLayer)), ("out_glue", GlueWeights)]


@cache
def model_decode_kernel() -> Callable | None:
    """csrc/model_decode.c's ``model_decode_step`` (a bfloat16 model's decode step in one call), or None."""
    fn = _function("model_decode", "model_decode_step",
                   [ctypes.POINTER(DecodeProgram), _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_int])
    if fn is not None:
        fn.restype = ctypes.c_int
    return fn
