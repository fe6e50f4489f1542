"""MLA attention over the pool's pages in key tiles with an online softmax (flash-attention style).

The naive kernels of :mod:`tidal.ops.mla` are the references: the expanded one materialises k_nope
and v for every cached token (L x heads x (d_nope + d_v) floats per call) and the absorbed one
reads a copy of every sequence padded to the longest. Here a step never holds more than one tile
of keys per sequence: memory is O(queries x tile) whatever the context length L.

One tile is ``tile`` tokens (a whole number of pages) of each sequence still that long, gathered
from its pages. Per tile, per query and head: scores against the tile's keys, then the running
max ``m``, sum ``l`` and weighted output ``acc`` are rescaled by ``exp(m_old - m_new)``. Tile 0
always holds key 0, which every query sees, so ``m`` is finite from the first tile on and a query
that sees nothing of a later tile (mask -inf everywhere) just keeps its state.

Two forms of the same math:

- expanded: each tile's latents are expanded to k_nope / v by W_UK / W_UV (prefill: many queries
  share one expansion);
- absorbed: W_UK is folded into the queries and W_UV applied to the latent output, keys are the
  raw cache rows (decode and short chunks; see :func:`use_absorbed`).

Tile sizes are fixed by the page size alone, never by the batch, so a sequence's arithmetic does
not depend on which other sequences share its step.
"""

from __future__ import annotations

import torch

from tidal.model.layers import compute_dtype
from tidal.ops.mla import split_kv_b

# Keys per tile (rounded down to whole pages): bounds a step's attention memory per sequence.
KEY_TILE_TOKENS = 1024
# Score elements (queries x heads x tile) of one expanded block: long chunks run in query blocks.
SCORE_BUDGET = 1 << 22


def key_tile(page_size: int, tokens: int = KEY_TILE_TOKENS) -> int:
    """Tile length in tokens: the whole pages that fit in ``tokens`` (at least one page)."""
    return max(1, tokens // page_size) * page_size


def use_absorbed(num_queries: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, v_dim: int) -> bool:
    """Absorbed costs ~2 (r + d_rope) multiply-adds per query, key and head; expanded costs
    r (d_nope + d_v) per key and head to expand (shared by the queries) plus (d_nope + d_rope + d_v)
    per query: absorbed wins below the crossover number of queries."""
    r = kv_lora_rank
    return num_queries * (2 * (r + rope_dim) - (nope_dim + rope_dim + v_dim)) < r * (nope_dim + v_dim)


def _gather_tile(pages: torch.Tensor, table: torch.Tensor, p0: int, p1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of pages ``table[:, p0:p1]`` of each sequence: [B, (p1 - p0) * page_size, C] in ``dtype``."""
    ids = table[:, p0:p1]
    rows = pages.index_select(0, ids.reshape(-1))
    return rows.view(ids.shape[0], -1, pages.shape[-1]).to(dtype)


def mla_tiled_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    pages: torch.Tensor,
    table: torch.Tensor,
    lengths: list[int],
    kv_b_weight: torch.Tensor,
    scale: float,
    *,
    absorbed: bool | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """Causal attention of B sequences' Q new queries each over their paged cache.

    q_nope [B, Q, n, d_nope], q_pe [B, Q, n, d_rope]; pages [P, page_size, r + d_rope] (one MLA
    layer of the pool); table [B, >= pages of the longest] page ids (entries past a sequence's
    pages: any valid id); lengths: each sequence's tokens including its Q new ones (>= Q; query t
    sits at position lengths[b] - Q + t). ``absorbed``: None picks by :func:`use_absorbed`.
    Returns [B, Q, n, d_v] in the query dtype; computes in float32 or wider.
    """
    B, Q, n, dn = q_nope.shape
    ps = pages.shape[1]
    tile = tile or key_tile(ps)
    if tile % ps:
        raise ValueError(f"key tile {tile} is not a whole number of {ps}-token pages")
    if any(L < Q for L in lengths):
        raise ValueError(f"sequence lengths {lengths} cannot hold {Q} queries each")
    cdt = compute_dtype(q_nope.dtype)
    w_uk, w_uv = split_kv_b(kv_b_weight.to(cdt), n, dn)
    r, dv = w_uk.shape[-1], w_uv.shape[1]
    if absorbed is None:
        absorbed = use_absorbed(Q, r, q_pe.shape[-1], dn, dv)
    dev = q_nope.device
    order = sorted(range(B), key=lambda b: -lengths[b])  # longest first: a tile's sequences are a prefix
    perm = torch.tensor(order, dtype=torch.long, device=dev)
    lens = [lengths[b] for b in order]
    table = table.index_select(0, perm)
    qn, qp = q_nope.index_select(0, perm).to(cdt), q_pe.index_select(0, perm).to(cdt)
    if absorbed:
        # [B, n, Q, r + d_rope]: a query against the raw cache row [c | k_pe]; values are c.
        query = torch.cat([torch.einsum("bqnd,ndr->bnqr", qn, w_uk), qp.transpose(1, 2)], dim=-1)

        def keys(rows: torch.Tensor):
            return rows.transpose(1, 2)[:, None], rows[:, None, :, :r]

        def scores(b: int, k, t0: int, t1: int) -> torch.Tensor:
            return query[:b, :, t0:t1] @ k

        out = _online_softmax(lens, Q, tile, ps, dev, cdt, (B, n, Q, r), keys, scores, pages, table, scale)
        o = torch.einsum("bnqr,nvr->bqnv", out, w_uv)
    else:
        qn_h, qp_h = qn.transpose(1, 2), qp.transpose(1, 2)  # [B, n, Q, d]

        def keys(rows: torch.Tensor):  # the tile's latents expanded once, for every query block
            c, k_pe = rows[..., :r], rows[..., r:]
            k_nope = torch.einsum("btr,ndr->bndt", c, w_uk)
            return (k_nope, k_pe.transpose(1, 2)[:, None]), torch.einsum("btr,nvr->bntv", c, w_uv)

        def scores(b: int, k, t0: int, t1: int) -> torch.Tensor:
            return qn_h[:b, :, t0:t1] @ k[0] + qp_h[:b, :, t0:t1] @ k[1]

        out = _online_softmax(lens, Q, tile, ps, dev, cdt, (B, n, Q, dv), keys, scores, pages, table, scale)
        o = out.transpose(1, 2)
    unperm = torch.empty_like(perm)
    unperm[perm] = torch.arange(B, device=dev)
    return o.index_select(0, unperm).to(q_nope.dtype)


def _online_softmax(
    lens: list[int], Q: int, tile: int, ps: int, dev: torch.device, cdt: torch.dtype,
    acc_shape: tuple[int, int, int, int], keys, scores, pages: torch.Tensor, table: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Sweep the key tiles of sequences sorted longest first. Per tile, ``keys(rows)`` turns the
    first b sequences' gathered rows [b, tile, C] into (key operand, values [b, n or 1, tile, d]);
    ``scores(b, key, t0, t1)`` gives queries t0..t1's unscaled scores [b, n, t1 - t0, tile]. Queries
    run in blocks of at most SCORE_BUDGET score elements. Returns the output [B, n, Q, d]."""
    B, n, _, d = acc_shape
    acc = torch.zeros(acc_shape, dtype=cdt, device=dev)
    m = torch.full((B, n, Q, 1), float("-inf"), dtype=cdt, device=dev)
    l = torch.zeros((B, n, Q, 1), dtype=cdt, device=dev)
    qblock = max(1, SCORE_BUDGET // (B * n * tile))
    # Query positions [B, Q]: sequence b's query t at lens[b] - Q + t.
    qpos = torch.tensor(lens, device=dev)[:, None] - Q + torch.arange(Q, device=dev)
    for k0 in range(0, lens[0], tile):
        b = sum(1 for L in lens if L > k0)  # sequences still this long (a prefix: sorted)
        rows = _gather_tile(pages, table[:b], k0 // ps, (k0 + tile) // ps, cdt)
        k1 = k0 + rows.shape[1]
        kpos = torch.arange(k0, k1, device=dev)
        if k1 > lens[b - 1]:  # rows past a sequence's end: whatever the page holds
            past = kpos[None, :] >= torch.tensor(lens[:b], device=dev)[:, None]
            rows = rows.masked_fill(past[..., None], 0)  # (0 x NaN would poison the output)
        key, v = keys(rows)
        for t0 in range(0, Q, qblock):
            t1 = min(Q, t0 + qblock)
            s = scores(b, key, t0, t1) * scale
            if k1 > lens[b - 1] - Q + t0:  # a key of the tile is in some query's future
                future = kpos[None, None, :] > qpos[:b, t0:t1, None]  # [b, q, tile]; hides rows past the end
                s = s.masked_fill(future[:, None], float("-inf"))
            mb, lb = m[:b, :, t0:t1], l[:b, :, t0:t1]
            m_new = torch.maximum(mb, s.amax(dim=-1, keepdim=True))
            alpha = torch.exp(mb - m_new)
            p = torch.exp(s - m_new)
            l[:b, :, t0:t1] = lb * alpha + p.sum(dim=-1, keepdim=True)
            acc[:b, :, t0:t1] = acc[:b, :, t0:t1] * alpha + p @ v
            m[:b, :, t0:t1] = m_new
    return acc / l
