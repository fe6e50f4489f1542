import math

import pytest
import torch

from tidal.ops.mla import gather_pages, mla_absorbed_attention, split_kv_b
from tidal.ops.triton.mla_decode import mla_decode_attention


def _paged(lengths, page, C, dtype, gen):
    """Random pages holding each sequence's rows in shuffled pages, and the page table."""
    counts = [-(-L // page) for L in lengths]
    total = sum(counts) + 3
    pages = torch.randn(total, page, C, generator=gen).to(dtype)
    ids = torch.randperm(total, generator=gen).tolist()
    width = max(max(counts), 1) + 1  # one spare column: any valid id past a sequence's pages
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    for b, n in enumerate(counts):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return pages, table


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_absorbed_reference(splits, dtype):
    gen = torch.Generator().manual_seed(splits)
    n, dn, dv, r, rope, page = 5, 8, 12, 24, 8, 4  # r and rope no powers of two above 16: masks
    lengths = torch.tensor([1, 7, 33, 16, 0])  # 0: a padded row of a captured batch
    pages, table = _paged(lengths.tolist(), page, r + rope, dtype, gen)
    q_nope = torch.randn(len(lengths), n, dn, generator=gen)
    q_pe = torch.randn(len(lengths), n, rope, generator=gen)
    kv_b = torch.randn(n * (dn + dv), r, generator=gen) / math.sqrt(r)
    scale = 0.3
    w_uk, w_uv = split_kv_b(kv_b, n, dn)
    query = torch.cat([torch.einsum("bnd,ndr->bnr", q_nope, w_uk), q_pe], dim=-1)
    o_lat, lse = mla_decode_attention(query, pages, table, lengths, r, scale, num_splits=splits)
    out = torch.einsum("bnr,nvr->bnv", o_lat, w_uv)

    live = lengths > 0
    latents = gather_pages(pages.double(), table.long()[live], lengths[live])
    ref = mla_absorbed_attention(q_nope[live, None].double(), q_pe[live, None].double(), latents, lengths[live],
                                 kv_b.double(), scale)[:, 0]
    scores = torch.einsum("bnc,blc->bnl", query[live].double(), latents) * scale
    scores = scores.masked_fill(torch.arange(latents.shape[1])[None, None] >= lengths[live][:, None, None], -math.inf)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out[live].double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[live].double(), scores.logsumexp(-1), atol=tol, rtol=tol)
    assert (o_lat[~live] == 0).all() and torch.isneginf(lse[~live]).all()
