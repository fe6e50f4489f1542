"""Paged, weight-absorbed MLA decode attention in Triton: split-K over the context, then a merge.

The fast form of ``tidal.ops.mla.mla_paged_decode``'s latent attention. Each query row is the
absorbed query ``[W_UK^T q_nope | q_pe]`` (width r + d_rope, the cache row's width); the kernel
reads the cache rows ``[c | k_pe]`` in place through tidal's page table and returns the latent
output (the softmax-weighted sum of c) and the log-sum-exp of the scores, which decode-context
parallelism needs to merge partial attentions across ranks.

Graph-safe: the grid depends only on shapes (batch, heads, a fixed number of splits), lengths are
read on the device, and a row of length 0 (a padded row of a captured batch) gives zeros and
LSE = -inf without reading any page.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.ops.triton import dot_dtype, next_power_of_2
from tidal.ops.triton.online_softmax import softmax_finish, softmax_tile

BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows)
BLOCK_N = 32  # keys per tile


@triton.jit
def _split_kernel(
    Q, Pages, Table, Lengths, O, Lse,
    stride_qb, stride_qh, stride_pp, stride_pr, stride_tb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    n_heads, scale, split_len,
    PAGE: tl.constexpr, R: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    r = tl.arange(0, BLOCK_R)
    rmask = r < R
    p = tl.arange(0, BLOCK_P)
    pmask = p < ROPE
    q_row = Q + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_pe = tl.load(q_row + R + p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    length = tl.load(Lengths + b).to(tl.int32)
    start = s * split_len
    end = tl.minimum(start + split_len, length)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for k0 in range(start, end, BLOCK_N):
        keys = k0 + tl.arange(0, BLOCK_N)
        kmask = keys < end
        page = tl.load(Table + b * stride_tb + keys // PAGE, mask=kmask, other=0).to(tl.int64)
        row = Pages + page * stride_pp + (keys % PAGE).to(tl.int64) * stride_pr
        c = tl.load(row[:, None] + r[None, :], mask=kmask[:, None] & rmask[None, :], other=0.0)
        k_pe = tl.load(row[:, None] + R + p[None, :], mask=kmask[:, None] & pmask[None, :], other=0.0)
        c = c.to(DOT)
        scores = tl.dot(q_lat.to(DOT), tl.trans(c), input_precision="ieee")
        scores += tl.dot(q_pe.to(DOT), tl.trans(k_pe.to(DOT)), input_precision="ieee")
        scores = tl.where(kmask[None, :], scores * scale, float("-inf"))
        m, l_sum, acc = softmax_tile(m, l_sum, acc, scores, c, DOT)
    out, lse = softmax_finish(m, l_sum, acc)
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + r[None, :], out,
             mask=hmask[:, None] & rmask[None, :])
    tl.store(Lse + b * stride_lb + heads * stride_lh + s, lse, mask=hmask)


@triton.jit
def _merge_kernel(
    O, Lse, Out, OutLse,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_xb, stride_xh, stride_yb,
    R: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < SPLITS
    r = tl.arange(0, BLOCK_R)
    rmask = r < R
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + sp, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - safe_top)  # exp(-inf) = 0 for empty splits
    total = tl.sum(w, 0)
    parts = tl.load(O + b * stride_ob + h * stride_oh + sp[:, None] * stride_os + r[None, :],
                    mask=smask[:, None] & rmask[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_xb + h * stride_xh + r, out, mask=rmask)
    tl.store(OutLse + b * stride_yb + h, tl.where(total > 0, safe_top + tl.log(total), float("-inf")))


def mla_decode_attention(
    query: torch.Tensor,
    pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    rank: int,
    scale: float,
    num_splits: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, n, r + d_rope] (absorbed), pages [P, page_size, r + d_rope] (rows contiguous),
    table [B, W] page ids (W * page_size >= every length), lengths [B] ->
    (latent output [B, n, r] float32, log-sum-exp of the scaled scores [B, n] float32).

    The context is cut into ``num_splits`` equal key ranges of W * page_size / num_splits keys, a
    split per program; the merge pass combines them by their LSEs."""
    B, n, C = query.shape
    P, page, width = pages.shape
    if width != C or pages.stride(2) != 1 or pages.stride(1) != C:
        raise ValueError(f"pages {list(pages.shape)} with strides {pages.stride()} do not hold rows of {C} values")
    if table.dim() != 2 or table.shape[0] != B or lengths.shape != (B,):
        raise ValueError(f"table {list(table.shape)} / lengths {list(lengths.shape)} do not match {B} queries")
    query = query.contiguous()
    rope = C - rank
    splits = max(1, min(num_splits, table.shape[1] * page))
    split_len = -(-table.shape[1] * page // splits)
    part = torch.empty(B, n, splits, rank, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(B, n, splits, dtype=torch.float32, device=query.device)
    block_r, block_p = next_power_of_2(rank), max(16, next_power_of_2(rope))
    grid = (B, -(-n // BLOCK_H), splits)
    _split_kernel[grid](
        query, pages, table, lengths, part, part_lse,
        query.stride(0), query.stride(1), pages.stride(0), pages.stride(1), table.stride(0),
        part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
        n, scale, split_len,
        PAGE=page, R=rank, ROPE=rope, BLOCK_R=block_r, BLOCK_P=block_p, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        DOT=dot_dtype(pages.dtype),
    )
    out = torch.empty(B, n, rank, dtype=torch.float32, device=query.device)
    lse = torch.empty(B, n, dtype=torch.float32, device=query.device)
    _merge_kernel[(B, n)](
        part, part_lse, out, lse,
        part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        R=rank, SPLITS=splits, BLOCK_R=block_r, BLOCK_S=next_power_of_2(splits),
    )
    return out, lse
