import pytest
import torch

from tidal.ops.mla import mla_naive_attention
from tidal.ops.triton.prefill_attention import mla_prefill_attention


@pytest.mark.parametrize("T,L,tile", [(1, 1, 4), (9, 9, 4), (5, 70, 16), (40, 57, 100)])
def test_prefill_attention_in_key_tiles_matches_naive(T, L, tile):
    gen = torch.Generator().manual_seed(T * 100 + L)
    n, dn, dr, dv, r = 3, 8, 4, 12, 20
    q_nope = torch.randn(T, n, dn, generator=gen)
    q_pe = torch.randn(T, n, dr, generator=gen)
    latents = torch.randn(L, r + dr, generator=gen)
    kv_b = torch.randn(n * (dn + dv), r, generator=gen) / r**0.5
    out = mla_prefill_attention(q_nope, q_pe, latents, kv_b, 0.4, key_tile=tile)
    ref = mla_naive_attention(q_nope.double(), q_pe.double(), latents.double(), kv_b.double(), 0.4)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
