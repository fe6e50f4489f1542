"""MLA prefill attention over the cached context in Triton: keys in tiles, merged by log-sum-exp.

The fast form of ``tidal.ops.mla.mla_naive_attention`` for long contexts: only one tile of the
context (``KEY_TILE`` positions) is ever expanded to per-head k_nope / v; a flash-attention kernel
attends the new queries to that tile (causal, queries at the context's last T positions) and
returns its output with the LSE; tiles are combined exactly by :func:`merge_attention`. Memory is
bounded by the tile, not the context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.ops.mla import split_kv_b
from tidal.ops.triton import dot_dtype, next_power_of_2
from tidal.ops.triton.online_softmax import softmax_finish, softmax_tile

KEY_TILE = 4096
BLOCK_M = 16
BLOCK_N = 32


@triton.jit
def _flash_kernel(
    Qn, Qp, Kn, Kp, V, O, Lse,
    T, L, q_pos0, k_pos0, scale,
    stride_qn, stride_qnh, stride_qp, stride_qph, stride_kn, stride_knh, stride_kp,
    stride_v, stride_vh, stride_o, stride_oh, stride_l,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    BDN: tl.constexpr, BDR: tl.constexpr, BDV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
):
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tmask = t < T
    dn, dr, dv = tl.arange(0, BDN), tl.arange(0, BDR), tl.arange(0, BDV)
    qn = tl.load(Qn + t[:, None] * stride_qn + h * stride_qnh + dn[None, :],
                 mask=tmask[:, None] & (dn[None, :] < DN), other=0.0).to(DOT)
    qp = tl.load(Qp + t[:, None] * stride_qp + h * stride_qph + dr[None, :],
                 mask=tmask[:, None] & (dr[None, :] < DR), other=0.0).to(DOT)
    q_pos = q_pos0 + t
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BDV], tl.float32)
    # keys past this block's last query are in every query's future
    end = tl.minimum(L, q_pos0 + tl.program_id(0) * BLOCK_M + BLOCK_M - k_pos0)
    for j0 in range(0, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jmask = j < L
        kn = tl.load(Kn + j[:, None] * stride_kn + h * stride_knh + dn[None, :],
                     mask=jmask[:, None] & (dn[None, :] < DN), other=0.0).to(DOT)
        kp = tl.load(Kp + j[:, None] * stride_kp + dr[None, :], mask=jmask[:, None] & (dr[None, :] < DR),
                     other=0.0).to(DOT)
        s = tl.dot(qn, tl.trans(kn), input_precision="ieee") + tl.dot(qp, tl.trans(kp), input_precision="ieee")
        visible = jmask[None, :] & ((k_pos0 + j)[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * scale, float("-inf"))
        v = tl.load(V + j[:, None] * stride_v + h * stride_vh + dv[None, :], mask=jmask[:, None] & (dv[None, :] < DV),
                    other=0.0).to(DOT)
        m, l_sum, acc = softmax_tile(m, l_sum, acc, s, v, DOT)
    out, lse = softmax_finish(m, l_sum, acc)
    tl.store(O + t[:, None] * stride_o + h * stride_oh + dv[None, :], out, mask=tmask[:, None] & (dv[None, :] < DV))
    tl.store(Lse + t * stride_l + h, lse, mask=tmask)


def flash_attention_tile(
    q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
    q_pos0: int, k_pos0: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries at positions q_pos0 + t to keys at k_pos0 + j: q_nope [T, n, dn],
    q_pe [T, n, dr], k_nope [L, n, dn], k_pe [L, dr] (shared by the heads), v [L, n, dv] ->
    (o [T, n, dv] float32, lse [T, n] float32; a query that sees no key gets 0 and -inf)."""
    T, n, dn = q_nope.shape
    L, dr, dv = k_nope.shape[0], q_pe.shape[-1], v.shape[-1]
    for t in (q_nope, q_pe, k_nope, k_pe, v):
        if t.stride(-1) != 1:
            raise ValueError("attention inputs need a contiguous last dimension")
    o = torch.empty(T, n, dv, dtype=torch.float32, device=q_nope.device)
    lse = torch.empty(T, n, dtype=torch.float32, device=q_nope.device)
    _flash_kernel[(triton.cdiv(T, BLOCK_M), n)](
        q_nope, q_pe, k_nope, k_pe, v, o, lse,
        T, L, q_pos0, k_pos0, scale,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), o.stride(0), o.stride(1), lse.stride(0),
        DN=dn, DR=dr, DV=dv, BDN=max(16, next_power_of_2(dn)), BDR=max(16, next_power_of_2(dr)),
        BDV=max(16, next_power_of_2(dv)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT=dot_dtype(k_nope.dtype),
    )
    return o, lse


def merge_attention(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from each one's (o [..., dv], lse [...])."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    wa, wb = torch.exp(lse_a - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    return o_a * wa + o_b * wb, lse


def mla_prefill_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, kv_b_weight: torch.Tensor, scale: float,
    key_tile: int = KEY_TILE,
) -> torch.Tensor:
    """:func:`tidal.ops.mla.mla_naive_attention`'s contract (T new queries, the last T of L cached
    latents [L, r + dr]) -> [T, n, dv] in the query dtype, expanding one key tile at a time."""
    T, n, dn = q_nope.shape
    L = latents.shape[0]
    if L < T:
        raise ValueError(f"{L} cached latents cannot hold {T} queries")
    w_uk, w_uv = split_kv_b(kv_b_weight.to(latents.dtype), n, dn)
    r = w_uk.shape[-1]
    qn, qp = q_nope.contiguous(), q_pe.contiguous()
    o = lse = None
    for k0 in range(0, L, key_tile):
        c, k_pe = latents[k0 : k0 + key_tile].split([r, latents.shape[1] - r], dim=-1)
        k_nope = torch.einsum("lr,ndr->lnd", c, w_uk).contiguous()
        v = torch.einsum("lr,nvr->lnv", c, w_uv).contiguous()
        o_t, lse_t = flash_attention_tile(qn, qp, k_nope, k_pe.contiguous(), v, L - T, k0, scale)
        o, lse = (o_t, lse_t) if o is None else merge_attention(o, lse, o_t, lse_t)
    return o.to(q_nope.dtype)
