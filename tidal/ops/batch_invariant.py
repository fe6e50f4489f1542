"""Deterministic inference (``--enable-deterministic-inference``, SGLang's name): every token's
arithmetic is the same whatever else runs in its step.

A BLAS matmul picks its blocking, and so the order of each row's sums, from the number of rows; a
chunked attention or KDA kernel computes a token differently from the decode kernel. In float32
the differences stay below greedy's margins; in bfloat16 they flip argmaxes. In this mode (entered
per step by the model runner, one flag per thread) the ops switch to forms where each row is one
fixed-order reduction that never looks at other rows (the approach of thinking-machines'
batch_invariant_ops and SGLang's deterministic mode, done here with the CPU C kernels):

- dense products: ``csrc/bf16_gemm.c`` for bfloat16 weights at any row count (a row's sum is the
  same at 1 or 4096 rows), other weights one row per call;
- attention: every query, prefill ones included, through the paged decode kernel
  ``csrc/mla_decode.c`` over its own prefix, with the weight absorption per head in the row kernel;
- KDA: every prefill token stepped through the decode kernel ``csrc/kda_decode.c``, so a token's
  state update is the same whether it was prefilled (in any chunking) or decoded;
- MoE: each expert's rows through the row kernel, added in ascending expert order;
- element-wise exp and sigmoid on narrow rows (router scores, KDA beta, AttnRes weights) on rows
  padded to whole vectors (:func:`rowwise`).

A request's greedy tokens then depend on nothing but the request: not on the batch, the chunk
size, prefix-cache hits or preemption. The cost (prefill loses BLAS's blocking and the chunked
KDA form) is measured by ``benchmarks/bench_deterministic.py``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from tidal.ops.cpu_kernels import amx_thread_off, bf16_gemm_kernel, kda_decode_kernel, mla_decode_kernel

_mode = threading.local()


def enabled() -> bool:
    """Whether the calling thread runs in deterministic mode."""
    return getattr(_mode, "on", False)


@contextmanager
def deterministic_mode(on: bool = True) -> Iterator[None]:
    """Run the block with the row-invariant ops (``on``) or the fast ones, restoring the mode after.
    The C kernels' AMX tile path (whose order is not the FMA tiles') follows the mode per thread."""
    before = enabled()
    _mode.on = on
    if bool(on) != before:  # every step enters the mode: the C switch only where it changes
        amx_thread_off(on)
    try:
        yield
    finally:
        _mode.on = before
        if bool(on) != before:
            amx_thread_off(before)


def check_available(device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError naming what is missing when the mode cannot run on this device."""
    if device.type != "cpu":
        raise ValueError(f"--enable-deterministic-inference runs on the CPU only for now, not on {device.type} "
                         "(its GPU kernels are not row-invariant yet)")
    missing = [name for name, kernel in (("bf16_gemm", bf16_gemm_kernel), ("mla_decode", mla_decode_kernel),
                                         ("kda_decode", kda_decode_kernel)) if kernel() is None]
    if missing:
        raise ValueError("--enable-deterministic-inference needs the CPU C kernels, and these could not be built: "
                         f"{', '.join(missing)} (a C compiler on PATH, TIDAL_CPU_KERNELS not 0)")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"--enable-deterministic-inference takes bfloat16 or float32 models, not {dtype}")


# Row width that element-wise kernels cover with whole vectors (two 16-float AVX-512 registers per
# step, the widest torch's CPU loops take), so no element of a padded row falls in a scalar tail.
VECTOR_ROW = 64


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (element-wise) on x [..., m], each row zero-padded to a whole number of VECTOR_ROW
    values: a value's lane in torch's vectorized loop, and so its rounding (vector exp and sigmoid
    differ from the scalar tail's in the last bit), no longer depends on how many rows there are."""
    m = x.shape[-1]
    padded = F.pad(x, (0, -m % VECTOR_ROW))
    return fn(padded)[..., :m]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w.t() (w [N, K]) in x's dtype, each row computed alone: float32 sums of a
    bfloat16 weight in the C row kernel, any other weight one row per call."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return F.linear(x, w)
    if w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2 and w.stride(1) == 1:
        out = bf16_gemm_kernel()(rows, w)
    else:
        out = torch.cat([F.linear(r, w) for r in rows.split(1)])
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per head h: x[:, h] [B, K] @ w[h].t() (w [n, N, K]) -> float32 [B, n, N], row-invariant."""
    w = w if w.dtype == torch.bfloat16 else w.float()
    return torch.stack([linear(x[:, h].float(), w[h] if w[h].stride(-1) == 1 else w[h].contiguous())
                        for h in range(w.shape[0])], dim=1)


def mla_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
    kv_b_weight: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Every query alone over its own prefix, as one decode query: q_nope [T, n, d_nope], q_pe
    [T, n, d_rope], pages [P, page_size, C], table [T, max pages] (query t's sequence's page ids),
    lengths [T] (query t attends to the first lengths[t] cached rows) -> [T, n, d_v] in q's dtype.

    A prefill query and the decode query at the same position get the same arithmetic: the same
    absorbed query (per-head row products), the same pages, the same online-softmax order."""
    from tidal.ops.mla import split_kv_b  # tidal.ops.mla reaches tidal.model.layers, which imports us

    T, n, dn = q_nope.shape
    w_uk, w_uv = split_kv_b(kv_b_weight, n, dn)
    q_lat = head_linear(q_nope, w_uk.transpose(1, 2))  # [T, n, r]
    query = torch.cat([q_lat, q_pe.float()], dim=-1)
    o_lat = mla_decode_kernel()(pages, table, lengths, query, w_uk.shape[-1], scale)
    return head_linear(o_lat, w_uv).to(q_nope.dtype)
