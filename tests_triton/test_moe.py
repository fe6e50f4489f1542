import pytest
import torch

from tidal.ops.activation import situ
from tidal.ops.mxfp import dequantize_mxfp4, quantize_mxfp4
from tidal.ops.triton.moe import align_blocks, fused_experts, grouped_gemm


def _reference(h, ids, weights, w13, w2, act):
    """Token by token, expert by expert, in float64."""
    out = torch.zeros(h.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(h.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (w13[e].double() @ h[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (w2[e].double() @ act(gate, up))
    return out


@pytest.mark.parametrize("T,k,E", [(1, 2, 5), (7, 3, 4), (40, 2, 6)])
def test_align_blocks_cover_every_slot_once(T, k, E):
    gen = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    b = align_blocks(ids, E, block_m=4)
    seen = []
    flat = ids.reshape(-1)[b.order]
    for e, s, end in zip(b.block_expert.tolist(), b.block_start.tolist(), b.block_end.tolist()):
        if e == E:
            continue
        rows = list(range(s, min(s + 4, end)))
        assert rows and all(flat[r] == e for r in rows)
        seen += rows
    assert sorted(seen) == list(range(T * k))


@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_fused_experts_match_reference(mxfp4, T):
    gen = torch.Generator().manual_seed(T + 10 * mxfp4)
    # widths that are no multiple of the 64-wide tiles exercise the masks (MXFP4: multiples of 32)
    E, k, d, inter = 6, 3, 96, (32 if mxfp4 else 48)
    h = torch.randn(T, d, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    w13 = torch.randn(E, 2 * inter, d, generator=gen) / d**0.5
    w2 = torch.randn(E, d, inter, generator=gen) / inter**0.5
    if mxfp4:
        w13_arg, w2_arg = quantize_mxfp4(w13), quantize_mxfp4(w2)
        w13, w2 = dequantize_mxfp4(*w13_arg, torch.float32), dequantize_mxfp4(*w2_arg, torch.float32)
    else:
        w13_arg, w2_arg = (w13, None), (w2, None)
    act = lambda g, u: situ(g, u, 4.0, 25.0)  # noqa: E731
    out = fused_experts(h, ids, weights, w13_arg, w2_arg, act)
    torch.testing.assert_close(out.double(), _reference(h, ids, weights, w13, w2, act), atol=2e-4, rtol=2e-4)


def test_mxfp4_gemm_decodes_every_code_and_scale():
    """Every E2M1 code in both nibbles, scales from tiny to large, against tidal.ops.mxfp."""
    E, N, K = 2, 16, 64
    packed = torch.arange(E * N * K // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(E, N, K // 2)
    scales = (torch.arange(E * N * K // 32).remainder(40) + 107).to(torch.uint8).view(E, N, K // 32)
    scales[0, 0, 0] = 0  # the subnormal scale 2^-127
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 1], [1, 0], [1, 1]])
    b = align_blocks(ids, E)
    y = grouped_gemm(x, b, packed, scales, rows=(b.order // 2).to(torch.int32))
    w = dequantize_mxfp4(packed, scales, torch.float64)
    ref = torch.stack([w[ids.reshape(-1)[s]] @ x[s // 2].double() for s in b.order.tolist()])
    torch.testing.assert_close(y.double(), ref, atol=1e-3, rtol=1e-4)  # float32 accumulation
