"""The fused CPU decode kernels (tidal/ops/fused_decode.py: RMSNorm, the gated activations, Block
AttnRes, the KDA layer step, the packed routed experts in one call; bfloat16 rows in and out of the
bf16 GEMM) against float64 token-by-token references on fresh random inputs; a row's bits alone ==
in a batch and at 1 == 2 threads; the torch form when they are off; the engine's greedy tokens with
and without them (float32, the embedded model)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tidal import LLM, SamplingParams
from tidal.embedded import embedded_model_dir
from tidal.model.attn_res import attn_res
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.kda import KimiDeltaAttention
from tidal.model.layers import rms_norm
from tidal.model.moe import Experts, KimiMLP, PackedExperts, Router
from tidal.ops import cpu_kernels, dense, fused_decode
from tidal.ops.fused_decode import BlockCache
from tidal.ops.activation import situ, swiglu
from tidal.ops.kda import kda_gate, kda_recurrent, l2_normalize
from tidal.ops.mxfp import dequantize_mxfp4
from tidal.ops.short_conv import causal_conv_step
from tidal.presets import tiny_k3, tiny_kimi_linear

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def kernels_built(monkeypatch):
    # The bits compared here are the C kernels': bf16 products of many rows stay in C (on CPUs with
    # AMX tiles a bfloat16 model's go to torch's matmul otherwise: tests/test_bf16_blas.py).
    monkeypatch.setenv("TIDAL_BF16_BLAS_MIN_ROWS", "0")
    if None in (cpu_kernels.rms_norm_kernel(), cpu_kernels.attn_res_kernels(), cpu_kernels.kda_layer_decode_kernel(),
                cpu_kernels.activation_kernel(), cpu_kernels.bf16_rows_kernel()):
        pytest.skip("no C compiler here: the torch forms run")


def one_call_variants(monkeypatch, module, x: torch.Tensor, kernel: str) -> tuple[torch.Tensor, ...]:
    """module(x) on 2 threads, row by row on 2 threads, on 1 thread, and with fused_decode.<kernel> off."""
    with torch.inference_mode():
        with threads(2):
            got = module(x)
            alone = torch.cat([module(x[t : t + 1]) for t in range(x.shape[0])])
        with threads(1):
            single = module(x)
        with monkeypatch.context() as m:
            m.setattr(fused_decode, kernel, lambda *a: None)
            separate = module(x)
    return got, alone, single, separate


def threads(n: int):
    class _Threads:
        def __enter__(self):
            self.old = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.old)

    return _Threads()


def reference_rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


# ---- RMSNorm -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, None])
def test_rms_norm_matches_float64_on_strided_rows(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(1)
    D = 77
    x = (3 * torch.randn(9, D + 5, generator=gen)).to(dtype)[:, 2 : 2 + D]  # rows with a gap
    w = None if weight_dtype is None else (1 + torch.randn(D, generator=gen)).to(weight_dtype)
    out = fused_decode.rms_norm(x, w, 1e-5)
    assert out is not None and out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), reference_rms_norm(x, w, 1e-5), rtol=tol, atol=tol)
    assert torch.equal(rms_norm(x, w, 1e-5), out)  # what the model's rms_norm runs


def test_rms_norm_rows_are_bitwise_batch_and_thread_invariant():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(64, 1100, generator=gen), torch.randn(1100, generator=gen)
    with threads(2):
        batch = fused_decode.rms_norm(x, w, 1e-6)
        alone = torch.cat([fused_decode.rms_norm(x[i : i + 1], w, 1e-6) for i in range(64)])
    with threads(1):
        single = fused_decode.rms_norm(x, w, 1e-6)
    assert torch.equal(batch, alone) and torch.equal(batch, single)


# ---- gated activations, bf16 GEMM rows, the router's weight ----------------------------------------


def reference_activation(g: torch.Tensor, u: torch.Tensor, betas: tuple[float, float] | None) -> torch.Tensor:
    g, u = g.double(), u.double()
    if betas is None:
        return g * torch.sigmoid(g) * u
    beta, lbeta = betas
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * lbeta * torch.tanh(u / lbeta)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("betas", [(4.0, 25.0), None])
def test_gated_activation_matches_float64_on_views_of_one_projection(dtype, betas):
    gen = torch.Generator().manual_seed(10)
    gu = (8 * torch.randn(6, 2 * 45, generator=gen)).to(dtype)  # gate | up halves, as KimiMLP splits them
    gate, up = gu[:, :45], gu[:, 45:]
    out = fused_decode.gated_activation(gate, up, betas)
    assert out is not None and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), reference_activation(gate, up, betas), rtol=tol, atol=tol)
    model_form = situ(gate, up, *betas) if betas else swiglu(gate, up)
    assert torch.equal(model_form, out)


@pytest.mark.parametrize("betas", [(4.0, 25.0), None])
def test_gated_activation_across_the_ranges_of_its_exp_and_tanh(betas):
    """Every range of the vector exp and tanh (and the tail columns' libm ones): near zero (tanh's
    polynomial), around its 0.625 switch, saturation, sigmoid's under- and overflow, inf and NaN;
    relative error within a few float32 ulps of the float64 reference."""
    gen = torch.Generator().manual_seed(12)
    spans = [1e-6, 1e-3, 0.3, 2.4, 2.6, 10.0, 60.0, 95.0, 300.0]
    g = torch.cat([s * (2 * torch.rand(1, 64, generator=gen) - 1) for s in spans], dim=1)
    u = torch.cat([s * (2 * torch.rand(1, 64, generator=gen) - 1) for s in reversed(spans)], dim=1)
    g, u = g[:, :-3], u[:, :-3]  # a tail past the last group of 8
    ref = reference_activation(g, u, betas)
    out = fused_decode.gated_activation(g, u, betas)
    assert out is not None
    rel = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-30))[ref.abs() > 1e-30]
    assert rel.max() < 2e-6, rel.max()
    special = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0, -200.0, 200.0, 0.0, 3.0, 1.0]])
    up = torch.tensor([[1.0, 2.0, 2.0, float("inf"), 1.0, 1.0, 5.0, float("nan"), -float("inf")]])
    got = fused_decode.gated_activation(special, up, betas)
    want = reference_activation(special, up, betas)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.allclose(got[finite].double(), want[finite], rtol=2e-6, atol=1e-30)


def test_gated_activation_rows_are_bitwise_batch_and_thread_invariant():
    gen = torch.Generator().manual_seed(11)
    g, u = 5 * torch.randn(40, 2000, generator=gen), 30 * torch.randn(40, 2000, generator=gen)
    assert fused_decode.gated_activation(g.repeat(2, 1), u.repeat(2, 1), None) is None  # past FUSED_MAX_ROWS
    with threads(2):
        batch = fused_decode.gated_activation(g, u, (4.0, 25.0))
        alone = torch.cat([fused_decode.gated_activation(g[i : i + 1], u[i : i + 1], (4.0, 25.0)) for i in range(40)])
    with threads(1):
        single = fused_decode.gated_activation(g, u, (4.0, 25.0))
    assert torch.equal(batch, alone) and torch.equal(batch, single)


def test_bf16_rows_in_and_out_equal_the_float32_kernel_rounded():
    """bfloat16 rows straight into the GEMM give the bits of widening them, the float32 kernel and
    .to(bfloat16); strided rows too, and any leading shape through dense.linear. (With the AMX tiles
    off: 9 rows take them, whose sums are not the float32 kernel's; tests/test_amx_tiles.py.)"""
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(70, 96, generator=gen).bfloat16()
    x = torch.randn(9, 100, generator=gen).bfloat16()[:, 3:99]
    with torch.inference_mode(), cpu_kernels.amx_rows(0):
        got = cpu_kernels.bf16_rows_kernel()(x, w)
        want = cpu_kernels.bf16_gemm_kernel()(x.float(), w).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    x3 = x.contiguous().view(3, 3, 96)
    assert torch.equal(dense.linear(x3, w), want.view(3, 3, 70))


def test_router_weight_cast_follows_in_place_updates():
    router = Router(tiny_k3())
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator().manual_seed(13))
        router.weight.data = router.weight.data.bfloat16()
        x = torch.randn(3, router.weight.shape[1]).bfloat16()
        first = router(x)
        router.weight.mul_(-1)  # an in-place write: the float32 copy is rebuilt
        second = router(x)
        fresh = Router(router.config)
        fresh.weight.data = router.weight.data.clone()
        fresh.e_score_correction_bias.data = router.e_score_correction_bias.data.clone()
        assert torch.equal(second[0], fresh(x)[0]) and not torch.equal(first[0], second[0])


@pytest.mark.parametrize("amx", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["situ", "swiglu"])
def test_packed_experts_in_one_call_equal_the_grouped_path_bitwise(monkeypatch, dtype, act, amx):
    """PackedExperts.forward at 1, 3, 16 and the most tokens it takes (128): the one-call kernel == the
    grouped-GEMM path, bit for bit where that path's activation is the same C code (up to
    FUSED_MAX_ROWS slots; past it torch's, within rounding); both == the float64 experts within
    rounding; a token's bits alone == in the batch. bfloat16 rows' gate|up products on the FMA tiles
    (amx 0) and on the AMX tiles at every group size (amx 1: at the default, groups of a few rows)."""
    with cpu_kernels.amx_rows(amx) as in_force:
        if in_force != amx:
            pytest.skip("no AMX-BF16 tiles on this CPU")
        packed_experts_against_grouped_path(monkeypatch, dtype, act)


def packed_experts_against_grouped_path(monkeypatch, dtype, act) -> None:
    config = replace(tiny_k3(), hidden_act=act)
    dense_experts = Experts(config)
    torch.manual_seed(14)
    for p in dense_experts.parameters():
        p.data.normal_(0, 0.3)
    packed = PackedExperts.from_dense(dense_experts)
    E, k = config.num_experts, config.num_experts_per_token
    gen = torch.Generator().manual_seed(15)
    for T in (1, 3, fused_decode.FUSED_MAX_ROWS // k, fused_decode.PACKED_EXPERTS_MAX_SLOTS // k):
        h = torch.randn(T, config.expert_hidden_size, generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=gen)
        calls = []
        with torch.inference_mode():
            got = packed(h, ids, w)
            alone = torch.cat([packed(h[t : t + 1], ids[t : t + 1], w[t : t + 1]) for t in range(T)])
            with monkeypatch.context() as m:  # the grouped-GEMM path (its activation is the same C code)
                m.setattr(fused_decode, "packed_experts", lambda *a: calls.append(1))
                want = packed(h, ids, w)
        assert calls and torch.equal(got, alone)
        if T * k <= fused_decode.FUSED_MAX_ROWS:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        ref = torch.zeros(T, h.shape[1], dtype=torch.float64)
        deq = {leaf: torch.stack([dequantize_mxfp4(packed.target(leaf, "packed")[e], packed.target(leaf, "scale")[e],
                                                   torch.float64) for e in range(E)]) for leaf in ("w1", "w3", "w2")}
        for t in range(T):
            for j in range(k):
                e, x = ids[t, j], h[t].double()
                g, u = deq["w1"][e] @ x, deq["w3"][e] @ x
                a = reference_activation(g, u, (config.situ_beta, config.situ_linear_beta) if act == "situ" else None)
                ref[t] += w[t, j].double() * (deq["w2"][e] @ a)
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


# ---- Block AttnRes -------------------------------------------------------------------------------


def reference_attn_res(partial, blocks, norm_w, proj_w, eps):
    values = torch.stack([*blocks, partial]).double()
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax(keys @ (norm_w.double() * proj_w.double().reshape(-1)), dim=0)
    return (alpha.unsqueeze(-1) * values).sum(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attn_res_matches_float64_with_blocks_cached_once(dtype):
    gen = torch.Generator().manual_seed(3)
    T, D, eps = 5, 67, 1e-5
    blocks: list[torch.Tensor] = []
    cache = BlockCache()
    for n in range(1, 5):  # the cache grows by one block per completed block, as in a forward pass
        blocks.append((2 * torch.randn(T, D, generator=gen)).to(dtype))
        partial = torch.randn(T, D, generator=gen).to(dtype)
        norm_w, proj_w = 1 + torch.randn(D, generator=gen), torch.randn(1, D, generator=gen)
        out = attn_res(partial, blocks, norm_w, proj_w, eps, cache)
        assert len(cache) == n and out.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), reference_attn_res(partial, blocks, norm_w, proj_w, eps),
                                   rtol=tol, atol=tol)
        torch.testing.assert_close(out, attn_res(partial, blocks, norm_w, proj_w, eps), rtol=tol, atol=tol)


def test_attn_res_rows_are_bitwise_batch_and_thread_invariant():
    gen = torch.Generator().manual_seed(4)
    T, D = 8, 300
    blocks = [torch.randn(T, D, generator=gen) for _ in range(3)]
    partial, query = torch.randn(T, D, generator=gen), torch.randn(D, generator=gen)
    with threads(2):
        batch = fused_decode.attn_res(partial, blocks, BlockCache(), query, 1e-6)
        alone = torch.cat([fused_decode.attn_res(partial[i : i + 1], [b[i : i + 1] for b in blocks], BlockCache(), query, 1e-6)
                           for i in range(T)])
    with threads(1):
        single = fused_decode.attn_res(partial, blocks, BlockCache(), query, 1e-6)
    assert torch.equal(batch, alone) and torch.equal(batch, single)


# ---- the KDA layer step --------------------------------------------------------------------------

H, K, W, N = 3, 20, 4, 9  # heads, head dim, conv taps, state slots
P = H * K


class Layer:
    """Random float64 weights of one KDA layer's recurrent part, and a pool of states whose slots sit
    in strided blocks (a gap after each, like the engine's pool)."""

    def __init__(self, gen: torch.Generator, bound: float | None, conv_dtype: torch.dtype) -> None:
        self.conv_w = 0.5 * torch.randn(3 * P, W, generator=gen, dtype=torch.float64)
        self.A_log = 0.5 * torch.randn((H, 1) if bound is not None else (1, K), generator=gen, dtype=torch.float64)
        self.dt_bias = torch.randn(P, generator=gen, dtype=torch.float64)
        self.o_norm = 1 + 0.1 * torch.randn(K, generator=gen, dtype=torch.float64)
        self.bound, self.eps = bound, 1e-5
        conv = torch.randn(N, (W - 1) * 3 * P, generator=gen).to(conv_dtype)
        self.conv = torch.cat([conv, torch.zeros(N, 7, dtype=conv_dtype)], 1)[:, : (W - 1) * 3 * P].unflatten(
            1, (W - 1, 3 * P))
        rec = torch.randn(N, H * K * K + 13, generator=gen)
        self.rec = rec[:, : H * K * K].unflatten(1, (H, K, K))
        self.conv_ref = self.conv.double().clone()
        self.rec_ref = self.rec.double().clone()

    def kernel(self, inputs, slots: list[int]) -> torch.Tensor:
        out = fused_decode.kda_layer_decode(
            *inputs, self.conv, self.rec, torch.tensor(slots, dtype=torch.int32), self.conv_w.float(),
            self.A_log.float(), self.dt_bias.float(), self.bound, self.o_norm.float(), self.eps)
        assert out is not None
        return out

    def reference(self, inputs, slots: list[int]) -> torch.Tensor:
        """Token by token in float64 with the model's torch ops."""
        outs = []
        for t, s in enumerate(slots):
            qkv, z, gate, b = (x[t : t + 1].double() for x in inputs)
            y, new_conv = causal_conv_step(qkv, self.conv_w, self.conv_ref[s : s + 1])
            y = y.to(inputs[0].dtype).double()  # the conv output is in the rows' dtype (the model's rounding)
            self.conv_ref[s] = new_conv[0]
            q, k, v = y.view(1, 3, H, K).unbind(1)
            g = kda_gate(z.view(1, H, K), self.A_log, self.dt_bias, self.bound)
            o, new_rec = kda_recurrent(*(x.unsqueeze(1) for x in (l2_normalize(q) * K**-0.5, l2_normalize(k), v, g)),
                                       torch.sigmoid(b).unsqueeze(1), self.rec_ref[s : s + 1])
            self.rec_ref[s] = new_rec[0]
            o = reference_rms_norm(o[:, 0], self.o_norm, self.eps) * torch.sigmoid(gate.view(1, H, K))
            outs.append(o.flatten(1))
        return torch.cat(outs)


def step_inputs(gen: torch.Generator, T: int, dtype: torch.dtype):
    """qkv, z, gate, b of T tokens as views of one projection output (row stride > width)."""
    fused = torch.randn(T, 3 * P + P + P + H + 3, generator=gen)
    fused[:, 3 * P : 4 * P] *= 3  # z: gates from near 0 to near the bound
    parts = fused.to(dtype).split([3 * P, P, P, H, 3], dim=1)
    return parts[:4]


@pytest.mark.parametrize("bound", [-5.0, None])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_layer_step_matches_float64_token_by_token(bound, dtype):
    """Six decode steps of five sequences in shuffled slots: outputs and both states == float64."""
    gen = torch.Generator().manual_seed(5)
    layer = Layer(gen, bound, dtype)
    for _ in range(6):
        slots = torch.randperm(N, generator=gen)[:5].tolist()
        inputs = step_inputs(gen, 5, dtype)
        out = layer.kernel(inputs, slots)
        torch.testing.assert_close(out.double(), layer.reference(inputs, slots), rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(layer.rec.double(), layer.rec_ref, rtol=2e-4, atol=2e-4)
    assert torch.equal(layer.conv.double(), layer.conv_ref)  # the conv state holds the inputs, exactly


def test_kda_layer_step_carries_nan_where_the_torch_form_does():
    """A NaN gate input makes its output NaN; a NaN decay input (z) spoils its head's state and output,
    and no other head's (the vector sigmoid and exp keep NaN, as libm's do)."""
    gen = torch.Generator().manual_seed(7)
    layer = Layer(gen, -5.0, torch.float32)
    for bound in (-5.0, None):
        layer.bound = bound
        qkv, z, gate, b = (x.clone() for x in step_inputs(gen, 2, torch.float32))
        gate[0, K + 3] = float("nan")  # head 1, channel 3
        z[1, 2] = float("nan")  # head 0
        out = layer.kernel((qkv, z, gate, b), [4, 6])
        nan = torch.zeros(2, P, dtype=torch.bool)
        nan[0, K + 3] = True
        nan[1, :K] = True
        assert torch.equal(out.isnan(), nan)
        assert layer.rec[6, 0].isnan().any() and not layer.rec[6, 1:].isnan().any()
        layer.rec[6].zero_()


def test_kda_layer_step_is_bitwise_batch_and_thread_invariant():
    gen = torch.Generator().manual_seed(6)
    inputs = step_inputs(gen, 8, torch.float32)
    layers = [Layer(torch.Generator().manual_seed(9), -5.0, torch.float32) for _ in range(3)]
    with threads(2):
        batch = layers[0].kernel(inputs, list(range(8)))
        alone = torch.cat([layers[1].kernel([x[t : t + 1] for x in inputs], [t]) for t in range(8)])
    with threads(1):
        single = layers[2].kernel(inputs, list(range(8)))
    assert torch.equal(batch, alone) and torch.equal(batch, single)
    assert torch.equal(layers[0].rec, layers[1].rec) and torch.equal(layers[0].rec, layers[2].rec)
    assert torch.equal(layers[0].conv, layers[1].conv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_layer_chain_equals_decode_steps_through_copied_blocks(dtype):
    """Chains (a verified chain's positions in order, each in its own block after a copy of the
    block before) and decodes in one call == one decode call per position with the copy done by
    torch: outputs and every state block bitwise, at 1 and 2 threads."""
    gen = torch.Generator().manual_seed(11)
    lens = [1, 3, 1, 2, 2]  # two decodes and three chains, as rows of one flat token run
    inputs = step_inputs(gen, sum(lens), dtype)
    blocks = torch.randperm(N, generator=gen).tolist()
    plan, at = [], 0
    for n in lens:
        plan.append([(at + j, blocks.pop()) for j in range(n)])
        at += n
    rows, slots, src, groups = [], [], [], [0]
    for group in plan:
        for j, (row, slot) in enumerate(group):
            rows.append(row)
            slots.append(slot)
            src.append(group[j - 1][1] if j else -1)
        groups.append(len(rows))
    index = (torch.tensor(rows), torch.tensor(slots, dtype=torch.int32), torch.tensor(src, dtype=torch.int32),
             torch.tensor(groups))
    want = Layer(torch.Generator().manual_seed(12), -5.0, dtype)
    expected = torch.empty(sum(lens), P)
    for j in range(max(lens)):
        for group in plan:
            if j < len(group):
                row, slot = group[j]
                if j:
                    want.conv[slot], want.rec[slot] = want.conv[group[j - 1][1]], want.rec[group[j - 1][1]]
                expected[row] = want.kernel([x[row : row + 1] for x in inputs], [slot])[0]
    for n in (1, 2):
        got = Layer(torch.Generator().manual_seed(12), -5.0, dtype)
        with threads(n):
            out = fused_decode.kda_layer_chain(*inputs, got.conv, got.rec, *index, got.conv_w.float(),
                                               got.A_log.float(), got.dt_bias.float(), got.bound, got.o_norm.float(),
                                               got.eps)
        assert out is not None
        assert torch.equal(out, expected)
        assert torch.equal(got.rec, want.rec) and torch.equal(got.conv, want.conv)


# ---- the whole KDA layer in one call ---------------------------------------------------------------


def bf16_kda_layer(config, seed: int) -> KimiDeltaAttention:
    """A bfloat16 KDA layer (float32 A_log and dt_bias, as the loader keeps them) with random weights."""
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(config, 0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "dt_bias":
                p.normal_(-2.0, 0.5)
            elif name in ("o_norm.weight", "A_log"):
                p.normal_(1.0 if name == "o_norm.weight" else 0.0, 0.3)
            elif "conv1d" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            if name not in ("A_log", "dt_bias"):
                p.data = p.data.bfloat16()
    return layer


def decode_steps(layer: KimiDeltaAttention, xs: torch.Tensor, slots: list[int], cache: SimpleCache) -> torch.Tensor:
    """xs [steps, len(slots), hidden]: one decode token per sequence per step, sequence i in state slot
    slots[i] of the cache (all of the cache's slots taking part). Returns the outputs [steps, n, hidden]."""
    outs = []
    n = len(slots)
    cache.state_slots = slots
    for t in range(xs.shape[0]):
        batch = simple_batch(layer.config, [1] * n, cache, [t] * n)
        with torch.inference_mode():
            outs.append(layer(xs[t], batch))
    return torch.stack(outs)


@pytest.mark.parametrize("preset", [tiny_k3, tiny_kimi_linear])
def test_kda_whole_layer_step_matches_float64_token_by_token(monkeypatch, preset):
    """A bfloat16 layer decoding 3 sequences for 12 steps through the one-call step: outputs and both
    states against the float64 layer (the model's torch ops) on the same weights, token by token, within
    the bfloat16 roundings of the intermediates; and the one-call step really ran."""
    config = preset()
    layer = bf16_kda_layer(config, seed=21)
    ref_layer = bf16_kda_layer(config, seed=21).to(torch.float64)
    calls = []
    real = fused_decode.kda_layer_step
    monkeypatch.setattr(fused_decode, "kda_layer_step", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(22)
    xs = torch.randn(12, 3, config.hidden_size, generator=gen)
    cache, ref_cache = SimpleCache(config, 3, torch.bfloat16), SimpleCache(config, 3, torch.float64)
    got = decode_steps(layer, xs.bfloat16(), [2, 0, 1], cache)
    want = decode_steps(ref_layer, xs.bfloat16().double(), [2, 0, 1], ref_cache)
    assert len(calls) == 12 and got.dtype == torch.bfloat16
    scale = want.abs().max()
    assert (got.double() - want).abs().max() / scale < 0.03
    conv, rec = cache.kda_state(0)
    ref_conv, ref_rec = ref_cache.kda_state(0)
    for state, ref in ((conv, ref_conv), (rec, ref_rec)):  # conv: the projections, rounded to bfloat16
        assert (state.double() - ref).abs().max() / ref.abs().max() < 0.03


# 8 sequences of 4 heads of 128: csrc/kda_layer_decode.c's RECURRENT_PARALLEL_MIN state values, so
# the recurrent part runs on 2 threads in the batch and on one for a row alone
THREADED_HEADS = {"kda_num_heads": 4, "kda_head_dim": 128}


@pytest.mark.parametrize("amx", [0, 1])
@pytest.mark.parametrize("preset,heads,n", [(tiny_k3, {}, 4), (tiny_kimi_linear, {}, 4),
                                            (tiny_k3, THREADED_HEADS, 8)])
def test_kda_whole_layer_step_has_the_bits_of_the_separate_calls(monkeypatch, preset, heads, n, amx):
    """The one call == the calls it replaces (parts product, f_b, the recurrent kernel, o_proj), bit
    for bit, in outputs and states; a row alone == in the batch and 1 == 2 threads, bitwise (also
    where the batch's recurrent part is threaded and the row alone's is not). The products on the
    FMA tiles (amx 0) and on the AMX tiles at every row count (amx 1: a row alone takes them too)."""
    with cpu_kernels.amx_rows(amx) as in_force:
        if in_force != amx:
            pytest.skip("no AMX-BF16 tiles on this CPU")
        kda_layer_step_against_separate_calls(monkeypatch, preset, heads, n)


def kda_layer_step_against_separate_calls(monkeypatch, preset, heads, n) -> None:
    config = replace(preset(), **heads)
    layer = bf16_kda_layer(config, seed=23)
    gen = torch.Generator().manual_seed(24)
    xs = torch.randn(5, n, config.hidden_size, generator=gen).bfloat16()
    slots = torch.randperm(n, generator=gen).tolist()
    runs = {}
    for name, fused, nt in (("fused", True, 2), ("separate", False, 2), ("one thread", True, 1)):
        with monkeypatch.context() as m, threads(nt):
            if not fused:
                m.setattr(fused_decode, "kda_layer_step", lambda *a: None)
            cache = SimpleCache(config, n, torch.bfloat16)
            runs[name] = (decode_steps(layer, xs, slots, cache), *(t.clone() for t in cache.kda_state(0)))
    alone = []
    for i, s in enumerate(slots):
        cache = SimpleCache(config, 1, torch.bfloat16)
        alone.append(decode_steps(layer, xs[:, i : i + 1], [0], cache))
    for name in ("separate", "one thread"):
        assert all(torch.equal(a, b) for a, b in zip(runs["fused"], runs[name])), name
    assert torch.equal(runs["fused"][0], torch.cat(alone, dim=1))


def test_kda_step_plan_follows_replaced_weights_and_declines_what_it_does_not_take(monkeypatch):
    """A weight given new storage rebuilds the plan (the old addresses would read freed memory); a
    float32 layer, TIDAL_CPU_KERNELS=0 and batch invariance run the separate path."""
    config = tiny_k3()
    layer = bf16_kda_layer(config, seed=25)
    x = torch.randn(2, config.hidden_size, generator=torch.Generator().manual_seed(26)).bfloat16()

    def one_step(fused: bool = True) -> torch.Tensor:
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(fused_decode, "kda_layer_step", lambda *a: None)
            return decode_steps(layer, x[None], [0, 1], SimpleCache(config, 2, torch.bfloat16))[0]

    first = one_step()
    plan = layer._step_plan()
    assert plan is not None and layer._step_plan() is plan
    layer.o_proj.weight.data = (2 * layer.o_proj.weight.data).clone()  # new storage, new values
    assert layer._step_plan() is not plan
    assert torch.equal(one_step(), one_step(fused=False)) and not torch.equal(one_step(), first)
    with torch.no_grad():
        layer.q_proj.weight.mul_(0.5)  # an in-place write: the same addresses, the plan rebuilt anyway
    assert torch.equal(one_step(), one_step(fused=False))
    assert bf16_kda_layer(config, seed=25).float()._step_plan() is None


# ---- the gated MLP in one call -------------------------------------------------------------------


def bf16_mlp(act: str, d: int, inter: int, seed: int) -> KimiMLP:
    config = replace(tiny_k3(), hidden_act=act)
    torch.manual_seed(seed)
    mlp = KimiMLP(config, d, inter)
    with torch.no_grad():
        for p in mlp.parameters():
            p.data = (p.data.normal_(0.0, 2.0 * p.shape[-1] ** -0.5)).bfloat16()
    return mlp


@pytest.mark.parametrize("act", ["situ", "swiglu"])
def test_mlp_step_matches_float64_and_has_the_bits_of_the_separate_calls(monkeypatch, act):
    """A bfloat16 gated MLP on 1, 5 and FUSED_MAX_ROWS rows in one call: within the bfloat16 roundings
    of its intermediates of the float64 MLP, the bits of the separate calls it replaces, a row alone ==
    in the batch and 1 == 2 threads, bitwise; more rows run the separate calls."""
    d, inter = 72, 200  # an activation width that is no multiple of 8: the tail columns' scalar form too
    mlp = bf16_mlp(act, d, inter, seed=31)
    betas = (mlp.config.situ_beta, mlp.config.situ_linear_beta) if act == "situ" else None
    calls = []
    real = fused_decode.mlp_step
    monkeypatch.setattr(fused_decode, "mlp_step", lambda *a: calls.append(real(*a) is not None) or real(*a))
    gen = torch.Generator().manual_seed(32)
    for T in (1, 5, fused_decode.FUSED_MAX_ROWS):
        x = torch.randn(T, d + 3, generator=gen).bfloat16()[:, 2 : 2 + d]  # rows at a stride
        got, alone, single, separate = one_call_variants(monkeypatch, mlp, x, "mlp_step")
        assert calls[-1] and got.dtype == torch.bfloat16
        assert torch.equal(got, separate) and torch.equal(got, alone) and torch.equal(got, single)
        g, u = x.double() @ mlp.gate_proj.weight.double().t(), x.double() @ mlp.up_proj.weight.double().t()
        ref = reference_activation(g, u, betas) @ mlp.down_proj.weight.double().t()
        assert (got.double() - ref).abs().max() / ref.abs().max() < 0.03
    calls.clear()
    with torch.inference_mode():
        mlp(torch.randn(fused_decode.FUSED_MAX_ROWS + 1, d).bfloat16())
    assert calls == [False]


def test_mlp_step_plan_follows_replaced_weights_and_declines_float32():
    mlp = bf16_mlp("situ", 64, 96, seed=33)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(34)).bfloat16()
    with torch.inference_mode():
        first = mlp(x)
        plan = mlp._step_plan()
        mlp.down_proj.weight.data = (-mlp.down_proj.weight.data).clone()  # new storage
        assert mlp._step_plan() is not plan
        assert torch.equal(mlp(x), -first)
    assert bf16_mlp("situ", 64, 96, seed=33).float()._step_plan() is None


def test_off_switch_and_unsupported_inputs_fall_back(monkeypatch):
    x = torch.randn(3, 16)
    monkeypatch.setenv("TIDAL_FUSED_DECODE", "0")
    assert fused_decode.rms_norm(x, None, 1e-6) is None
    assert fused_decode.attn_res(x, [x], [], torch.randn(16), 1e-6) is None
    monkeypatch.setenv("TIDAL_FUSED_DECODE", "1")
    assert fused_decode.rms_norm(x.double(), None, 1e-6) is None  # float64 runs the torch form
    assert fused_decode.rms_norm(x.requires_grad_(), None, 1e-6) is None  # autograd too
    xt = x.detach().t()  # columns: not rows with unit stride, the torch form
    torch.testing.assert_close(rms_norm(xt, None, 1e-6), reference_rms_norm(xt, None, 1e-6).float())


def test_kernels_off_when_cpu_kernels_disabled(monkeypatch):
    try:
        monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")
        for fn in (cpu_kernels._library, cpu_kernels.rms_norm_kernel, cpu_kernels.attn_res_kernels,
                   cpu_kernels.kda_layer_decode_kernel, cpu_kernels.kda_layer_step_kernels,
                   cpu_kernels.mlp_step_kernels, cpu_kernels.moe_router_kernel):
            fn.cache_clear()
        x = torch.randn(3, 16)
        assert fused_decode.rms_norm(x, None, 1e-6) is None
        torch.testing.assert_close(rms_norm(x, None, 1e-6), reference_rms_norm(x, None, 1e-6).float())
        w, bias = torch.randn(12, 16), torch.randn(12) * 0.1
        assert fused_decode.router(x, w, bias, 3, 1, 1, True, 1.0) is None
        router = Router(replace(tiny_k3(), hidden_size=16, num_experts=12, num_experts_per_token=3,
                                num_expert_group=1, topk_group=1))
        with torch.no_grad():
            router.weight.copy_(w)
            router.e_score_correction_bias.copy_(bias)
            ids, weights = router(x)
        want_ids, want_w = reference_router(x, w, bias, 3, 1, 1, True, router.config.routed_scaling_factor)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights.double(), want_w, rtol=2e-6, atol=1e-7)
    finally:
        monkeypatch.delenv("TIDAL_CPU_KERNELS")
        for fn in (cpu_kernels._library, cpu_kernels.rms_norm_kernel, cpu_kernels.attn_res_kernels,
                   cpu_kernels.kda_layer_decode_kernel, cpu_kernels.kda_layer_step_kernels,
                   cpu_kernels.mlp_step_kernels, cpu_kernels.moe_router_kernel):
            fn.cache_clear()


# ---- the MoE router ------------------------------------------------------------------------------


def reference_router(x, w, bias, k, n_group, topk_group, renormalize, scale):
    """Router.forward in float64, row by row; ties at the cut choose the lower expert index."""
    ids, weights = [], []
    for row in x.double():
        score = torch.sigmoid(w.double() @ row)
        key = score + bias.double()
        if n_group > 1 and topk_group < n_group:
            grouped = key.view(n_group, -1)
            group_score = grouped.sort(descending=True, stable=True).values[:, :2].sum(-1)
            keep = sorted(range(n_group), key=lambda g: (-group_score[g].item(), g))[:topk_group]
            mask = torch.ones(n_group, dtype=torch.bool)
            mask[keep] = False
            key = grouped.masked_fill(mask[:, None], float("-inf")).view(-1)
        chosen = sorted(range(key.numel()), key=lambda e: (-key[e].item(), e))[:k]
        wt = score[chosen]
        if renormalize:
            wt = wt / (wt.sum() + 1e-20)
        ids.append(chosen)
        weights.append(wt * scale)
    return torch.tensor(ids, dtype=torch.int64), torch.stack(weights)


ROUTER_CASES = [  # (d, experts, k, groups, kept groups, renormalize, scale)
    (77, 12, 3, 1, 1, True, 1.0), (768, 32, 4, 1, 1, True, 2.5), (130, 24, 5, 4, 2, True, 1.7),
    (33, 16, 2, 8, 3, False, 1.0), (257, 40, 6, 5, 5, True, 1.0),
]


@pytest.mark.parametrize("case", ROUTER_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_router_matches_float64_and_the_torch_form(monkeypatch, case, dtype, weight_dtype):
    d, E, k, n_group, topk_group, renorm, scale = case
    gen = torch.Generator().manual_seed(d * E + k)
    config = replace(tiny_k3(), hidden_size=d, num_experts=E, num_experts_per_token=k, num_expert_group=n_group,
                     topk_group=topk_group, moe_renormalize=renorm, routed_scaling_factor=scale)
    router = Router(config)
    with torch.no_grad():
        router.weight.data = (torch.randn(E, d, generator=gen) / d**0.5).to(weight_dtype)
        router.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    for T in (1, 7, 37):
        x = torch.randn(T + 3, d, generator=gen).to(dtype)[2:-1]  # a view: rows at an offset
        with torch.no_grad():
            ids, weights = router(x)
            want_ids, want_w = reference_router(x, router.weight, router.e_score_correction_bias, k, n_group,
                                                topk_group, renorm, scale)
            monkeypatch.setenv("TIDAL_FUSED_DECODE", "0")
            torch_ids, torch_w = router(x)
            monkeypatch.setenv("TIDAL_FUSED_DECODE", "1")
            assert fused_decode.router(x, router.weight, router.e_score_correction_bias, k, n_group, topk_group,
                                       renorm, scale) is not None
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (T, k)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights.double(), want_w, rtol=2e-6, atol=1e-7)
        # torch's form: the same experts (in its order of equal keys: none here), weights within rounding
        assert torch.equal(torch_ids.sort(-1).values, ids.sort(-1).values)
        order = [t * k + ids[t].tolist().index(e) for t in range(T) for e in torch_ids[t].tolist()]
        torch.testing.assert_close(torch_w.reshape(-1), weights.reshape(-1)[order], rtol=2e-6, atol=1e-7)


def test_router_rows_are_bitwise_batch_and_thread_invariant():
    gen = torch.Generator().manual_seed(5)
    d, E, k = 300, 64, 6  # 64 rows: enough work for the kernel's threads
    w = torch.randn(E, d, generator=gen).bfloat16()
    bias = torch.randn(E, generator=gen) * 0.05
    x = torch.randn(64, d, generator=gen).bfloat16()
    with threads(2):
        ids, weights = fused_decode.router(x, w, bias, k, 4, 2, True, 2.0)
    with threads(1):
        ids1, weights1 = fused_decode.router(x, w, bias, k, 4, 2, True, 2.0)
    assert torch.equal(ids, ids1) and torch.equal(weights, weights1)
    for t in (0, 17, 63):
        alone_ids, alone_w = fused_decode.router(x[t : t + 1].clone(), w, bias, k, 4, 2, True, 2.0)
        assert torch.equal(alone_ids[0], ids[t]) and torch.equal(alone_w[0], weights[t])


def test_router_ties_choose_the_lower_expert_and_nan_ranks_first():
    E, d = 16, 8
    w = torch.zeros(E, d)
    w[3], w[9], w[12] = 1.0, 1.0, 1.0  # three equal scores above the rest
    x = torch.ones(1, d)
    bias = torch.zeros(E)
    ids, weights = fused_decode.router(x, w, bias, 2, 1, 1, False, 1.0)
    assert ids.tolist() == [[3, 9]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[8.0, 8.0]])))
    bias[5] = float("nan")
    ids, _ = fused_decode.router(x, w, bias, 2, 1, 1, False, 1.0)
    assert ids.tolist() == [[5, 3]]  # torch.topk ranks NaN above every number


def test_router_declines_what_it_does_not_cover():
    w, bias, x = torch.randn(12, 8), torch.zeros(12), torch.randn(2, 8)
    assert fused_decode.router(x.double(), w.double(), bias, 2, 1, 1, True, 1.0) is None  # float64
    assert fused_decode.router(x, w, bias, 13, 1, 1, True, 1.0) is None  # k above the experts
    assert fused_decode.router(x, w, bias, 2, 5, 2, True, 1.0) is None  # groups do not divide the experts
    assert fused_decode.router(x, w.t().contiguous().t(), bias, 2, 1, 1, True, 1.0) is None  # strided weight
    assert fused_decode.router(x, w.requires_grad_(), bias, 2, 1, 1, True, 1.0) is None  # autograd


# ---- the engine ----------------------------------------------------------------------------------


def test_engine_greedy_tokens_equal_with_and_without_the_fused_kernels(monkeypatch, dtype="float32"):
    """float32 embedded model: the same greedy tokens with the kernels on (batched and alone) and
    off, and the KDA layers really ran their fused step. (In bfloat16 the torch ops and the C
    kernels round differently, so the whole switch flips near-tied tokens; the bf16 test below
    switches the MLA decode kernel alone.)"""
    calls = []
    real = fused_decode.kda_layer_decode

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fused_decode, "kda_layer_decode", counted)
    llm = LLM(str(embedded_model_dir()), dtype=dtype, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    prompts = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9], [42] * 6, list(range(30, 60))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def greedy(batch: bool) -> list[list[int]]:
        if batch:
            return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        return [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]

    monkeypatch.setenv("TIDAL_FUSED_DECODE", "0")
    want = greedy(True)
    assert not any(calls)
    monkeypatch.setenv("TIDAL_FUSED_DECODE", "1")
    assert greedy(True) == want
    assert any(calls)
    assert greedy(False) == want


@pytest.mark.parametrize("kernel", ["mla_absorbed_for", "router", "kda_layer_step", "mlp_step", "moe_layer_step",
                                    "mla_layer_step", "sigmoid_gate", "attn_res_glue"])
def test_engine_bf16_greedy_tokens_equal_with_and_without_a_kernel(monkeypatch, kernel):
    """bfloat16 embedded model: the same greedy tokens, batched and alone, whether MLA decode reads
    kv_b_proj's bf16 weight in place (csrc/mla_decode.c) or through the float32 copy of the torch
    path, and whether the router runs in one C call (csrc/moe_router.c) or as the torch ops of
    tidal/model/moe.py, and whether a KDA layer's decode step, a gated MLP and a whole MoE layer are
    one C call each or the separate ones, whether the MLA output gate is C's sigmoid or torch's, and
    whether the glue between sub-layers (residual add, AttnRes, RMSNorm) is one call or three.
    (A layer's one call runs its parts itself: the router's case turns the MoE layer's off, the MLA
    decode kernel's and the gate's the MLA layer's.)"""
    from tidal.ops import mla as mla_ops

    # the whole step in one call (tests/test_model_decode.py) runs the layers' kernels from C
    monkeypatch.setattr(fused_decode, "model_decode_step", lambda *args: None)
    if kernel == "router":
        monkeypatch.setattr(fused_decode, "moe_layer_step", lambda *args: None)
    if kernel in ("mla_absorbed_for", "sigmoid_gate"):
        monkeypatch.setattr(fused_decode, "mla_layer_step", lambda *args: None)
    owner = mla_ops if kernel == "mla_absorbed_for" else fused_decode
    calls = []
    real = getattr(owner, kernel)

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(owner, kernel, counted)
    llm = LLM(str(embedded_model_dir()), dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    prompts = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9], [42] * 6, list(range(30, 60))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    on = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert calls and all(calls)
    alone = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    monkeypatch.setattr(owner, kernel, lambda *args: None)
    off = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert on == alone == off
