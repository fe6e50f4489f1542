"""DCP: attention over each rank's token slice (logical token i on rank i % N), merged exactly,
equals single-rank MLA attention; on fresh random inputs, incl. ranks with no token of a request."""

import pytest
import torch

from tidal.ops.attn_merge import merge_attention, merge_attention_reference, partial_attention
from tidal.ops.mla import mla_absorbed_attention, split_kv_b

N_HEADS, D_NOPE, D_ROPE, D_V, RANK = 3, 8, 4, 8, 16


def _absorbed_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    w_uk, _ = split_kv_b(w, N_HEADS, D_NOPE)
    return torch.cat([torch.einsum("bqnd,ndr->bqnr", q_nope, w_uk), q_pe], dim=-1)


def _rank_slice(latents: torch.Tensor, lengths: list[int], rank: int, size: int):
    """Rank ``rank``'s rows of each sequence (padded with key position -1)."""
    rows = [latents[b, rank : lengths[b] : size] for b in range(len(lengths))]
    width = max(1, max(r.shape[0] for r in rows))
    out = latents.new_zeros(len(lengths), width, latents.shape[-1])
    pos = torch.full((len(lengths), width), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
        pos[b, : r.shape[0]] = torch.arange(r.shape[0]) * size + rank
    return out, pos


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("queries", [1, 5])
def test_dcp_merge_equals_single_rank(size: int, queries: int) -> None:
    g = torch.Generator().manual_seed(100 * size + queries)
    lengths = [queries, queries + 1, 2 * size + 3, 17][: 4]  # the first: fewer tokens than ranks
    lengths = [max(n, queries) for n in lengths]
    B, Lmax = len(lengths), max(lengths)
    dt = torch.float64
    latents = torch.randn(B, Lmax, RANK + D_ROPE, generator=g, dtype=dt)
    for b, n in enumerate(lengths):
        latents[b, n:] = 0
    q_nope = torch.randn(B, queries, N_HEADS, D_NOPE, generator=g, dtype=dt)
    q_pe = torch.randn(B, queries, N_HEADS, D_ROPE, generator=g, dtype=dt)
    w = torch.randn(N_HEADS * (D_NOPE + D_V), RANK, generator=g, dtype=dt) / RANK**0.5
    scale = 0.3
    want = mla_absorbed_attention(q_nope, q_pe, latents, torch.tensor(lengths), w, scale)

    query = _absorbed_query(q_nope, q_pe, w)
    query_pos = torch.tensor([[n - queries + t for t in range(queries)] for n in lengths])
    outs, lses = [], []
    for r in range(size):
        rows, pos = _rank_slice(latents, lengths, r, size)
        o, lse = partial_attention(query, rows, pos, query_pos, RANK, scale)
        outs.append(o)
        lses.append(lse)
    if queries == 1 and size > 1:  # the 1-token request: ranks 1.. hold nothing of it
        assert all(torch.isinf(lse[0]).all() for lse in lses[1:])
    merged = merge_attention(torch.stack(outs), torch.stack(lses))
    assert torch.allclose(merged, merge_attention_reference(outs, lses), atol=1e-12)
    _, w_uv = split_kv_b(w, N_HEADS, D_NOPE)
    got = torch.einsum("bqnr,nvr->bqnv", merged, w_uv)
    assert torch.allclose(got, want, atol=1e-10), (got - want).abs().max()


def test_merge_of_one_part_is_that_part() -> None:
    g = torch.Generator().manual_seed(7)
    o = torch.randn(1, 4, 3, 5, generator=g, dtype=torch.float64)
    lse = torch.randn(1, 4, 3, generator=g, dtype=torch.float64)
    assert torch.equal(merge_attention(o, lse), o[0])


def test_float32_partials_merge_close_to_float64() -> None:
    g = torch.Generator().manual_seed(8)
    outs = torch.randn(4, 6, 2, 16, generator=g)
    lses = torch.randn(4, 6, 2, generator=g) * 30  # wide spread of magnitudes
    lses[1, 0] = float("-inf")
    got = merge_attention(outs, lses)
    want = merge_attention_reference(list(outs), list(lses))
    assert torch.allclose(got.double(), want, atol=1e-5)
