"""Grouped expert GEMMs in Triton for routed MoE: token slots sorted by expert, one launch for all
experts, no host sync and no per-expert Python loop.

The fast form of ``tidal.model.moe.Experts.forward``'s products. Weights are either dense
[E, N, K] (bf16 / fp32) or MXFP4 in the compressed-tensors layout that checkpoints and
``tidal.ops.mxfp`` use: ``packed`` uint8 [E, N, K/2] (input column 2j in the low nibble of byte j)
and ``scales`` uint8 [E, N, K/32] (E8M0 exponents); E2M1 is decoded in the kernel to the dot's
operand type (Hopper has no FP4 tensor cores; ``tl.dot_scaled`` upcasts the same way there).

Work is cut into row blocks of BLOCK_M slots of ONE expert (:func:`align_blocks`); the number of
blocks is bounded by the shapes alone (``ceil(T*k / BLOCK_M) + min(E, T*k)``), so the grid is fixed
for a captured CUDA graph and blocks past the used ones exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from tidal.ops.triton import dot_dtype

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64


@dataclass(frozen=True)
class ExpertBlocks:
    """Token slots sorted by expert and cut into per-expert row blocks (all device tensors)."""

    order: torch.Tensor  # [T*k] slot ids (t*k + j) in expert order, stable
    block_expert: torch.Tensor  # [max_blocks] int32 expert of each block; num_experts: unused block
    block_start: torch.Tensor  # [max_blocks] int32 first sorted row of the block
    block_end: torch.Tensor  # [max_blocks] int32 end of the block's expert's rows

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> ExpertBlocks:
    """ids [T, k] expert ids -> :class:`ExpertBlocks`, with torch ops on the ids' device only."""
    flat = ids.reshape(-1)
    slots = flat.numel()
    order = torch.sort(flat, stable=True).indices
    # scatter_add, not bincount: CUDA's bincount reads the max on the host (a sync, no graph capture)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    blocks = (counts + block_m - 1) // block_m
    block_ends = blocks.cumsum(0)
    max_blocks = -(-slots // block_m) + min(num_experts, slots)
    b = torch.arange(max_blocks, device=ids.device)
    expert = torch.searchsorted(block_ends, b, right=True)  # num_experts past the last used block
    e = expert.clamp(max=num_experts - 1)
    first_block = block_ends[e] - blocks[e]
    used = expert < num_experts
    start = torch.where(used, ends[e] - counts[e] + (b - first_block) * block_m, 0)
    end = torch.where(used, ends[e], 0)
    return ExpertBlocks(order, expert.to(torch.int32), start.to(torch.int32), end.to(torch.int32))


@triton.jit
def _e2m1(code):
    """E2M1 codes (int32, 0..15) -> float32 values: sign bit 3, exponent bits 2..1, mantissa bit 0."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _grouped_kernel(
    X, Rows, W, S, Y, BlockExpert, BlockStart, BlockEnd,
    N, K, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    NUM_EXPERTS: tl.constexpr, GATHER: tl.constexpr, MXFP4: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    expert = tl.load(BlockExpert + pid)
    if expert >= NUM_EXPERTS:
        return
    rows = tl.load(BlockStart + pid) + tl.arange(0, BLOCK_M)
    rmask = rows < tl.load(BlockEnd + pid)
    src = tl.load(Rows + rows, mask=rmask, other=0).to(tl.int64) if GATHER else rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    w_rows = W + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = S + expert.to(tl.int64) * stride_se + cols.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        x = tl.load(X + src[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if MXFP4:
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            byte = tl.load(w_rows + half[None, :], mask=cmask[:, None] & (half[None, :] < K // 2), other=0)
            byte = byte.to(tl.int32)
            w = tl.reshape(tl.join(_e2m1(byte & 15), _e2m1(byte >> 4)), (BLOCK_N, BLOCK_K))
            grp = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            e8 = tl.load(s_rows + grp[None, :], mask=cmask[:, None] & (grp[None, :] < K // 32), other=127)
            e8 = e8.to(tl.int32)
            scale = tl.where(e8 == 0, 1 << 22, e8 << 23).to(tl.float32, bitcast=True)
            w = tl.reshape(tl.reshape(w, (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None], (BLOCK_N, BLOCK_K))
        else:
            w = tl.load(w_rows + kk[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.dot(x.to(DOT), tl.trans(w.to(DOT)), input_precision="ieee")
    tl.store(Y + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])


def grouped_gemm(
    x: torch.Tensor,
    blocks: ExpertBlocks,
    weight: torch.Tensor,
    scales: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[i] = x[rows[i]] @ W_{e(i)}^T for every sorted slot i (e(i) its expert) -> [T*k, N] float32.

    ``weight``: dense [E, N, K], or with ``scales`` MXFP4 packed [E, N, K/2] + scales [E, N, K/32].
    ``rows`` [T*k]: the x row of each sorted slot (its token); None when x is already in sorted order."""
    E, N = weight.shape[:2]
    K = x.shape[1]
    mxfp4 = scales is not None
    if mxfp4:
        if weight.dtype != torch.uint8 or scales.dtype != torch.uint8 or weight.shape[2] * 2 != K \
                or scales.shape != (E, N, K // 32) or K % 32:
            raise ValueError(f"MXFP4 weights {list(weight.shape)} / scales {list(scales.shape)} do not fit "
                             f"inputs of width {K}")
    elif weight.shape[2] != K:
        raise ValueError(f"expert weights {list(weight.shape)} do not fit inputs of width {K}")
    if weight.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError("expert weights and inputs need contiguous rows")
    slots = blocks.order.shape[0]
    y = torch.empty(slots, N, dtype=torch.float32, device=x.device)
    s = scales if mxfp4 else weight
    dot = dot_dtype(x.dtype)
    grid = (blocks.num_blocks, triton.cdiv(N, BLOCK_N))
    _grouped_kernel[grid](
        x, rows if rows is not None else blocks.order, weight, s, y,
        blocks.block_expert, blocks.block_start, blocks.block_end,
        N, K, x.stride(0), weight.stride(0), weight.stride(1), s.stride(0), s.stride(1), y.stride(0),
        NUM_EXPERTS=E, GATHER=rows is not None, MXFP4=mxfp4, DOT=dot,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return y


def fused_experts(
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: tuple[torch.Tensor, torch.Tensor | None],
    w2: tuple[torch.Tensor, torch.Tensor | None],
    activate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_j weights[t, j] * w2_e(act(w13_e h_t)) over each token's experts e = ids[t, j] -> [T, d]
    float32. w13 / w2: (dense weight, None) or (packed, scales); w13's rows are [gate | up].

    Each token's k outputs are summed in routing order after an exact scatter (no atomics): a
    token's result does not depend on the other tokens of the batch."""
    T, k = ids.shape
    num_experts = w13[0].shape[0]
    blocks = align_blocks(ids, num_experts)
    token_of = (blocks.order // k).to(torch.int32)
    gate_up = grouped_gemm(h, blocks, w13[0], w13[1], rows=token_of)
    gate, up = gate_up.tensor_split(2, dim=1)
    act = activate(gate.to(h.dtype), up.to(h.dtype)).contiguous()
    y = grouped_gemm(act, blocks, w2[0], w2[1])
    out = torch.empty(T * k, y.shape[1], dtype=torch.float32, device=h.device)
    out[blocks.order] = y  # slots are a permutation: each row written once
    return (out.view(T, k, -1) * weights.to(torch.float32).unsqueeze(-1)).sum(1)
