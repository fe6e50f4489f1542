"""NoPE multi-head latent attention kernels (spec §2.1), in pure PyTorch.

Both kernels read the MLA cache format: one row per token, ``[c | k_pe]`` with c the normalised
latent (kv_lora_rank values) and k_pe the single rope-part key shared by all heads (NoPE: never
rotated). ``kv_b_weight`` is ``kv_b_proj.weight`` [n*(d_nope+d_v), r]; per head h its rows
``[h*(d_nope+d_v), h*(d_nope+d_v)+d_nope)`` are W_UK_h and the next d_v rows are W_UV_h.

- :func:`mla_naive_attention` expands k_nope / v for every cached position: cheap per query when
  many queries share the expansion (prefill).
- :func:`mla_absorbed_attention` never expands: W_UK is folded into the query and W_UV applied to
  the latent output, so the per-position cost is one dot product over the r+d_rope cache row
  (decode, short multi-token queries).

Everything inside runs in float32 or wider (``compute_dtype``) and is returned in the query dtype.
"""

from __future__ import annotations

import torch

from tidal.model.layers import compute_dtype
from tidal.ops.cpu_kernels import mla_absorbed_for, mla_decode_for

# Upper bound on score elements (heads x queries x keys) the naive kernel materialises at once;
# longer prefills are processed in query chunks so memory stays bounded (~1 GiB in float32).
NAIVE_SCORE_BUDGET = 1 << 28


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight -> (W_UK [n, d_nope, r], W_UV [n, d_v, r]) views."""
    rows, rank = kv_b_weight.shape
    if rows % num_heads:
        raise ValueError(f"kv_b_proj has {rows} rows, not a multiple of {num_heads} heads")
    w = kv_b_weight.view(num_heads, rows // num_heads, rank)
    return w[:, :nope_dim], w[:, nope_dim:]


def mla_naive_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latents: torch.Tensor,
    kv_b_weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Expanded causal attention of one sequence's T new queries over its L cached latents.

    q_nope [T, n, d_nope], q_pe [T, n, d_rope], latents [L, r + d_rope] (L >= T; the new tokens
    are the last T rows, so query t sits at absolute position L - T + t) -> [T, n, d_v].
    """
    T, n, dn = q_nope.shape
    L = latents.shape[0]
    if L < T:
        raise ValueError(f"{L} cached latents cannot hold {T} queries")
    cdt = compute_dtype(q_nope.dtype)
    w_uk, w_uv = split_kv_b(kv_b_weight.to(cdt), n, dn)
    r = w_uk.shape[-1]
    c, k_pe = latents.to(cdt).split([r, latents.shape[1] - r], dim=-1)
    k_nope = torch.einsum("lr,ndr->lnd", c, w_uk)  # [L, n, d_nope]
    v = torch.einsum("lr,nvr->lnv", c, w_uv)  # [L, n, d_v]
    qn, qp = q_nope.to(cdt), q_pe.to(cdt)
    key_pos = torch.arange(L, device=latents.device)
    out = torch.empty(T, n, w_uv.shape[1], dtype=cdt, device=q_nope.device)
    chunk = max(1, NAIVE_SCORE_BUDGET // max(1, n * L))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        scores = torch.einsum("tnd,lnd->ntl", qn[t0:t1], k_nope)
        scores = (scores + torch.einsum("tnd,ld->ntl", qp[t0:t1], k_pe)) * scale
        query_pos = torch.arange(L - T + t0, L - T + t1, device=latents.device)
        future = key_pos[None, :] > query_pos[:, None]  # [t, L]
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out[t0:t1] = torch.einsum("ntl,lnv->tnv", probs, v)
    return out.to(q_nope.dtype)


def mla_absorbed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latents: torch.Tensor,
    lengths: torch.Tensor,
    kv_b_weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Weight-absorbed causal attention of B sequences, Q new queries each, over padded latents.

    q_nope [B, Q, n, d_nope], q_pe [B, Q, n, d_rope]; latents [B, Lmax, r + d_rope], sequence b's
    first ``lengths[b]`` rows valid (its Q new tokens being the last Q of them, so query t sits at
    position lengths[b] - Q + t), the rest padding. lengths: int tensor [B], each >= Q.
    Returns [B, Q, n, d_v].
    """
    B, Q, n, dn = q_nope.shape
    Lmax = latents.shape[1]
    cdt = compute_dtype(q_nope.dtype)
    w_uk, w_uv = split_kv_b(kv_b_weight.to(cdt), n, dn)
    # q~_h = W_UK_h^T q_nope_h; with q_pe appended it is a query against the raw cache row [c | k_pe].
    q_lat = torch.einsum("bqnd,ndr->bqnr", q_nope.to(cdt), w_uk)
    query = torch.cat([q_lat, q_pe.to(cdt)], dim=-1).reshape(B, Q * n, -1)
    kv = latents.to(cdt)
    scores = torch.bmm(query, kv.transpose(1, 2)).view(B, Q, n, Lmax) * scale
    lengths = lengths.to(device=latents.device, dtype=torch.long)
    key_pos = torch.arange(Lmax, device=latents.device)
    query_pos = lengths[:, None] - Q + torch.arange(Q, device=latents.device)  # [B, Q]
    # Every query sits before its sequence's end, so the causal mask also hides the padding.
    future = key_pos[None, None, :] > query_pos[:, :, None]  # [B, Q, Lmax]
    probs = scores.masked_fill(future[:, :, None, :], float("-inf")).softmax(dim=-1)
    r = w_uk.shape[-1]
    o_lat = torch.bmm(probs.view(B, Q * n, Lmax), kv[..., :r]).view(B, Q, n, r)
    return torch.einsum("bqnr,nvr->bqnv", o_lat, w_uv).to(q_nope.dtype)


def pad_latents(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence latents [L_b, C] -> (zero-padded [B, max L_b, C], lengths [B] long)."""
    lengths = torch.tensor([x.shape[0] for x in rows], dtype=torch.long, device=rows[0].device)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lengths


def gather_pages(pages: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Rows of paged sequences, zero-padded: pages [P, page_size, C], table [B, max_pages] page ids
    (any valid id past a sequence's pages), lengths [B] -> [B, max length, C]. One index_select."""
    B, width = table.shape
    rows = pages.index_select(0, table.flatten()).view(B, width * pages.shape[1], pages.shape[2])
    rows = rows[:, : int(lengths.max())]
    past = torch.arange(rows.shape[1], device=rows.device)[None, :] >= lengths[:, None]
    return rows.masked_fill_(past.unsqueeze(-1), 0)


def mla_paged_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    kv_b_weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode query per sequence against its paged cache: q_nope [B, n, d_nope], q_pe [B, n,
    d_rope], pages/table/lengths as :func:`gather_pages` -> [B, n, d_v].

    On the CPU a C kernel reads the pages in place (``tidal.ops.cpu_kernels``); elsewhere the
    absorbed form runs over key tiles of the pages (:mod:`tidal.ops.mla_tiled`): no copy padded to
    the longest sequence (the same math; the tests compare them)."""
    from tidal.ops.mla_tiled import mla_tiled_attention  # it builds on this module's split_kv_b

    absorbed = mla_absorbed_for(pages, q_nope, q_pe, kv_b_weight)
    if absorbed is not None:  # kv_b_proj's weight read in place: no float32 copy of it per step
        return absorbed(q_nope, q_pe, pages, table, lengths, kv_b_weight, scale)
    B, n, dn = q_nope.shape
    cdt = compute_dtype(q_nope.dtype)
    w_uk, w_uv = split_kv_b(kv_b_weight.to(cdt), n, dn)
    query = torch.cat([torch.einsum("bnd,ndr->bnr", q_nope.to(cdt), w_uk), q_pe.to(cdt)], dim=-1)
    kernel = mla_decode_for(pages, query) if cdt == torch.float32 else None
    if kernel is None:
        return mla_tiled_attention(q_nope[:, None], q_pe[:, None], pages, table, lengths.tolist(), kv_b_weight,
                                   scale, absorbed=True)[:, 0]
    o_lat = kernel(pages, table, lengths, query, w_uk.shape[-1], scale)
    return torch.einsum("bnr,nvr->bnv", o_lat, w_uv).to(q_nope.dtype)
