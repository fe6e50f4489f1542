"""MoE routing and experts, SiTU, and Block AttnRes against per-token references written from the spec."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tidal.config import ModelConfig
from tidal.model import layers, moe as moe_module
from tidal.model.attn_res import attn_res
from tidal.model.checkpoint import load_model, save_model
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.model.layers import inference_layout
from tidal.model.moe import Experts, KimiMLP, KimiMoE, blocks, project, project_each
from tidal.ops.activation import situ, swiglu
from tidal.presets import tiny_k3, tiny_k3_dict, tiny_kimi_linear, tiny_kimi_linear_dict

DT = torch.float64


def _moe(config_dict: dict, seed: int) -> KimiMoE:
    config = ModelConfig.from_dict(config_dict)
    moe = init_weights(KimiMoE(config), seed=seed).to(DT)
    with torch.no_grad():  # a bias large enough to change choices, so "bias only chooses" is tested
        moe.gate.e_score_correction_bias.copy_(torch.randn(config.num_experts, dtype=DT) * 0.3)
    return moe


def _fuse(module: torch.nn.Module) -> torch.nn.Module:
    for m in module.modules():
        if isinstance(m, (KimiMLP, Experts)):
            m.fuse_weights()
    return module


def _reference_moe(moe: KimiMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, straight from spec §3."""
    c = moe.config
    out = []
    for t in range(x.shape[0]):
        xt = x[t]
        scores = torch.sigmoid(moe.gate.weight @ xt)
        key = scores + moe.gate.e_score_correction_bias
        chosen = sorted(range(c.num_experts), key=lambda e: -key[e].item())[: c.num_experts_per_token]
        w = torch.stack([scores[e] for e in chosen])
        if c.moe_renormalize:
            w = w / (w.sum() + 1e-20)
        w = w * c.routed_scaling_factor
        h = moe.routed_expert_down_proj.weight @ xt if c.is_latent_moe else xt
        y = torch.zeros_like(h)
        for wi, e in zip(w, chosen):
            g = moe.experts.w1[e] @ h
            u = moe.experts.w3[e] @ h
            if c.hidden_act == "situ":
                a = c.situ_beta * torch.tanh(g / c.situ_beta) * torch.sigmoid(g)
                act = a * c.situ_linear_beta * torch.tanh(u / c.situ_linear_beta)
            else:
                act = g * torch.sigmoid(g) * u
            y = y + wi * (moe.experts.w2[e] @ act)
        if c.is_latent_moe:
            if c.latent_moe_use_norm:
                y = y / torch.sqrt((y * y).mean() + c.rms_norm_eps) * moe.routed_expert_norm.weight
            y = moe.routed_expert_up_proj.weight @ y
        s = moe.shared_experts
        g, u = s.gate_proj.weight @ xt, s.up_proj.weight @ xt
        if c.hidden_act == "situ":
            act = c.situ_beta * torch.tanh(g / c.situ_beta) * torch.sigmoid(g) * c.situ_linear_beta * torch.tanh(u / c.situ_linear_beta)
        else:
            act = g * torch.sigmoid(g) * u
        out.append(y + s.down_proj.weight @ act)
    return torch.stack(out)


def test_k3_latent_moe_matches_per_token_reference():
    moe = _moe(tiny_k3_dict(num_experts=8, top_k=3), seed=0)
    x = torch.randn(37, moe.config.hidden_size, dtype=DT)
    torch.testing.assert_close(moe(x), _reference_moe(moe, x), rtol=1e-10, atol=1e-10)


def test_kimi_linear_moe_matches_per_token_reference():
    d = tiny_kimi_linear_dict(num_experts=8, top_k=2)
    moe = _moe(d, seed=1)
    assert moe.config.routed_scaling_factor != 1.0
    x = torch.randn(29, moe.config.hidden_size, dtype=DT)
    torch.testing.assert_close(moe(x), _reference_moe(moe, x), rtol=1e-10, atol=1e-10)


LAYOUTS = {  # (FEATURE_MAJOR_MAX_ROWS, FEATURE_MAJOR_MAX_BYTES)
    "default": (moe_module.FEATURE_MAJOR_MAX_ROWS, moe_module.FEATURE_MAJOR_MAX_BYTES),
    "token-major": (0, 0),
    "feature-major": (64, 1 << 30),  # every group of up to 64 rows
}


@pytest.mark.parametrize("block_rows", [Experts.BLOCK_ROWS, 7])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("preset", ["k3", "kimi-linear"])
def test_moe_matches_reference_for_every_batch_size_layout_and_block(preset, fused, layout, block_rows, monkeypatch):
    """T = 1 (the single-token path), few and many rows per expert; blocks of 7 rows put every group
    in a block of its own, some bigger than a block."""
    monkeypatch.setattr(moe_module, "FEATURE_MAJOR_MAX_ROWS", LAYOUTS[layout][0])
    monkeypatch.setattr(moe_module, "FEATURE_MAJOR_MAX_BYTES", LAYOUTS[layout][1])
    monkeypatch.setattr(Experts, "BLOCK_ROWS", block_rows)
    d = tiny_k3_dict(num_experts=8, top_k=3) if preset == "k3" else tiny_kimi_linear_dict(num_experts=8, top_k=2)
    moe = _moe(d, seed=4)
    if fused:
        _fuse(moe)
    gen = torch.Generator().manual_seed(5)
    for T in (1, 2, 5, 61):
        x = torch.randn(T, moe.config.hidden_size, dtype=DT, generator=gen)
        torch.testing.assert_close(moe(x), _reference_moe(moe, x), rtol=1e-10, atol=1e-10)


def _token_rel_err(got: torch.Tensor, expect: torch.Tensor) -> float:
    """Largest over tokens of |got - expect|_2 / |expect|_2."""
    return ((got - expect).norm(dim=-1) / expect.norm(dim=-1)).max().item()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("preset", ["k3", "kimi-linear"])
def test_token_output_does_not_depend_on_the_rest_of_the_batch(preset, fused):
    """float32: each token alone (the single-token path) and inside a batch of 32 mixed tokens (the
    grouped path, 2-12 rows per expert): the routed experts' sum agrees within 1e-6 relative (2-5e-7
    measured), the whole layer within 3e-6 (its latent RMSNorm and the shared expert add their own
    rounding; up to 1e-6 measured). Matmuls of different row counts round differently, so bitwise
    equality is not promised."""
    d = tiny_k3_dict(num_experts=8, top_k=3) if preset == "k3" else tiny_kimi_linear_dict(num_experts=8, top_k=2)
    for seed in range(3):
        moe = init_weights(KimiMoE(ModelConfig.from_dict(d)), seed=seed)
        if fused:
            _fuse(moe)
        x = torch.randn(32, moe.config.hidden_size, generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            batch = moe(x)
            alone = torch.cat([moe(x[t : t + 1]) for t in range(32)])
            h = moe.routed_expert_down_proj(x) if moe.config.is_latent_moe else x
            ids, weights = moe.gate(x)
            experts_batch = moe.experts(h, ids, weights)
            experts_alone = torch.cat([moe.experts(h[t : t + 1], ids[t : t + 1], weights[t : t + 1]) for t in range(32)])
        assert _token_rel_err(experts_alone, experts_batch) < 1e-6
        assert _token_rel_err(alone, batch) < 3e-6


@pytest.mark.parametrize("fused", [False, True])
def test_single_token_path_is_bitwise_the_grouped_path(fused):
    """A token alone and the same token twice (each of its experts then gets 2 rows, computed like the
    single row padded to 2) give the same bits."""
    moe = init_weights(KimiMoE(tiny_k3(num_experts=8, top_k=3)), seed=6)
    if fused:
        _fuse(moe)
    x = torch.randn(8, moe.config.hidden_size)
    with torch.inference_mode():
        h = moe.routed_expert_down_proj(x)
        ids, weights = moe.gate(x)
        for t in range(8):
            two = [t, t]
            pair = moe.experts(h[two], ids[two], weights[two])
            alone = moe.experts(h[t : t + 1], ids[t : t + 1], weights[t : t + 1])
            assert torch.equal(pair[:1], alone) and torch.equal(pair[1:], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_weights_match_unfused(dtype):
    """fuse_weights changes neither the state dict nor (beyond rounding) the outputs."""
    moe = init_weights(KimiMoE(tiny_k3(num_experts=8, top_k=3)), seed=7).to(dtype)
    fused = _fuse(copy.deepcopy(moe))
    assert fused.experts.w13 is not None and fused.shared_experts.gate_up is not None
    before, after = moe.state_dict(), fused.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[k], after[k]) and before[k].shape == after[k].shape for k in before)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    gen = torch.Generator().manual_seed(8)
    with torch.inference_mode():
        for T in (1, 3, 32, 700):
            x = torch.randn(T, moe.config.hidden_size, generator=gen).to(dtype)
            assert _token_rel_err(fused(x), moe(x)) < tol
            assert _token_rel_err(fused.shared_experts(x), moe.shared_experts(x)) < tol


def test_fused_mlp_is_one_matmul_on_views_and_tracks_the_parameters():
    mlp = init_weights(KimiMLP(tiny_kimi_linear(), 64, 96), seed=9)
    mlp.fuse_weights()
    gate_up, inter = mlp.gate_up, 96
    assert gate_up is not None and gate_up.shape == (2 * inter, 64)
    assert mlp.gate_proj.weight.data_ptr() == gate_up.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == gate_up[inter:].data_ptr()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(11))
    other = init_weights(KimiMLP(tiny_kimi_linear(), 64, 96), seed=10)
    with torch.no_grad():
        mlp.load_state_dict(other.state_dict())  # copies into the views: the fused tensor follows
        assert mlp.gate_up is gate_up
        # One fused product against two: the same sums in another order (a stale copy is off by O(1)).
        torch.testing.assert_close(mlp(x), other(x), rtol=1e-5, atol=1e-5)


def test_fused_mlp_survives_the_serving_relayout_of_every_linear():
    """The serving path stores every nn.Linear weight in ``inference_layout`` after fuse_weights
    (``process_weights_after_loading``); the fused gate/up views are in that layout already, so
    they stay views, and the other weights' new layout only changes how project multiplies them."""
    moe = init_weights(KimiMoE(tiny_k3(num_experts=8, top_k=2)), seed=14)  # float32: the relaid-out dtype
    x = torch.randn(5, moe.config.hidden_size)
    expect = _reference_moe(moe.to(DT), x.to(DT)).float()
    moe = moe.float()
    _fuse(moe)
    gate_up = moe.shared_experts.gate_up
    for m in moe.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.data = inference_layout(m.weight)
    assert not moe.routed_expert_down_proj.weight.is_contiguous()
    with torch.no_grad():
        for T in (1, 2, 5):
            torch.testing.assert_close(moe(x[:T]), expect[:T], rtol=1e-5, atol=1e-5)
    assert moe.shared_experts.gate_up is gate_up


def test_checkpoint_written_after_fusing_equals_the_one_written_before(tmp_path):
    """Fused views share storage; the writer must still produce the same tensors (dense and MXFP4)."""
    for i, config in enumerate((tiny_k3(mxfp4=False), tiny_k3())):
        model = init_weights(KimiForCausalLM(config), seed=15)
        save_model(model, tmp_path / f"plain{i}")
        _fuse(model)
        save_model(model, tmp_path / f"fused{i}")
        plain = load_model(tmp_path / f"plain{i}", dtype=torch.float32).state_dict()
        fused = load_model(tmp_path / f"fused{i}", dtype=torch.float32).state_dict()
        assert all(torch.equal(plain[k], fused[k]) for k in plain)


def test_cast_after_fusing_falls_back_and_drops_the_stale_tensor():
    moe = init_weights(KimiMoE(tiny_k3(num_experts=8, top_k=2)), seed=11)
    _fuse(moe)
    moe = moe.to(torch.float64)  # replaces every parameter: the fused float32 tensors are stale
    x = torch.randn(6, moe.config.hidden_size, dtype=DT)
    with torch.no_grad():
        got = moe(x)
    assert moe.experts.w13 is None and moe.shared_experts.gate_up is None
    torch.testing.assert_close(got, _reference_moe(moe, x), rtol=1e-10, atol=1e-10)
    _fuse(moe)  # fusing again works at the new dtype
    assert moe.experts.w13.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(moe(x), got, rtol=1e-12, atol=1e-12)


def test_gradients_reach_the_parameters_of_a_fused_model():
    """With autograd on, forward runs unfused (the fused tensor is outside the graph)."""
    plain = init_weights(KimiMoE(tiny_k3(num_experts=8, top_k=2)), seed=12).to(DT)
    fused = _fuse(copy.deepcopy(plain))
    x = torch.randn(9, plain.config.hidden_size, dtype=DT)
    for m in (plain, fused):
        m(x).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        if name.endswith("e_score_correction_bias"):  # only chooses: no gradient in either
            assert p.grad is None and q.grad is None
            continue
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_project_is_linear_in_both_layouts(dtype):
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(48, 40, generator=gen).to(dtype)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    for n in range(14):
        x = torch.randn(n, 40, generator=gen).to(dtype)
        expect = (x.double() @ w.double().t()).to(dtype)
        torch.testing.assert_close(project(x, w), expect, rtol=tol, atol=tol)
        torch.testing.assert_close(project(x.t().contiguous().t(), w), expect, rtol=tol, atol=tol)  # strided x
        w_in = w.t().contiguous().t()  # input-major: the plain product, whatever the row count
        torch.testing.assert_close(project(x, w_in), expect, rtol=tol, atol=tol)
    ws = [torch.randn(48, 40, generator=gen).to(dtype) for _ in range(5)]
    x = torch.randn(5, 40, generator=gen).to(dtype)
    each = project_each(x, ws)
    one = project_each(x[:1], ws)
    for j, w in enumerate(ws):  # bit for bit the single-row products of project
        assert torch.equal(each[j], project(x[j : j + 1], w)[0])
        assert torch.equal(one[j], project(x[:1], w)[0])


def test_blocks_cover_the_groups_in_order():
    counts = [3, 4, 1, 9, 2, 2, 2, 12, 1]
    cut = blocks(counts, 7)
    assert cut == [(0, 2), (2, 3), (3, 4), (4, 7), (7, 8), (8, 9)]
    assert blocks([], 7) == []
    for i, j in cut:
        assert j - i == 1 or sum(counts[i:j]) <= 7


def test_situ_and_swiglu_in_place_equal_the_autograd_formulas(monkeypatch):
    """Without autograd the torch forms overwrite fresh buffers: same operations, same bits. (Up to
    FUSED_MAX_ROWS rows the CPU runs the C form, csrc/activation.c: equal within float32 rounding.)"""
    g, u = torch.randn(300, 40) * 6, torch.randn(300, 40) * 30
    with torch.no_grad():
        c_form = torch.cat([situ(g[i : i + 50], u[i : i + 50], 4.0, 25.0) for i in range(0, 300, 50)]), \
            torch.cat([swiglu(g[i : i + 50], u[i : i + 50]) for i in range(0, 300, 50)])
        monkeypatch.setenv("TIDAL_FUSED_DECODE", "0")
        fast = situ(g, u, 4.0, 25.0), swiglu(g, u)
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    slow = situ(gg, uu, 4.0, 25.0), swiglu(gg, uu)
    assert torch.equal(fast[0], slow[0].detach()) and torch.equal(fast[1], slow[1].detach())
    assert torch.equal(g, gg.detach()) and torch.equal(u, uu.detach())  # inputs untouched
    for c, s in zip(c_form, slow):
        torch.testing.assert_close(c, s.detach(), rtol=1e-5, atol=1e-5)


def test_router_bias_only_chooses():
    moe = _moe(tiny_k3_dict(num_experts=8, top_k=2), seed=2)
    x = torch.randn(50, moe.config.hidden_size, dtype=DT)
    ids, weights = moe.gate(x)
    scores = torch.sigmoid(x @ moe.gate.weight.t())
    unbiased = scores.topk(2, dim=-1).indices
    assert (ids.sort(-1).values != unbiased.sort(-1).values).any(), "bias should change some choices"
    expect = scores.gather(1, ids)
    expect = expect / expect.sum(-1, keepdim=True) * moe.config.routed_scaling_factor
    torch.testing.assert_close(weights, expect)


def test_group_limited_routing_keeps_only_top_groups():
    d = tiny_k3_dict(num_experts=8, top_k=2)
    d["text_config"].update(num_expert_group=4, topk_group=1)
    moe = _moe(d, seed=3)
    ids, _ = moe.gate(torch.randn(40, moe.config.hidden_size, dtype=DT))
    groups = ids // 2  # 4 groups of 2 experts
    assert (groups == groups[:, :1]).all()


def test_situ_definition_and_swiglu_limit():
    g, u = torch.randn(1000, dtype=DT) * 6, torch.randn(1000, dtype=DT) * 30
    expect = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)
    torch.testing.assert_close(situ(g, u, 4.0, 25.0), expect)
    assert situ(g, u, 4.0, 25.0).abs().max() <= 4.0 * 25.0
    torch.testing.assert_close(situ(g, u, 1e6, 1e6), swiglu(g, u), rtol=1e-6, atol=1e-6)


def test_attn_res_against_spec_formula():
    torch.manual_seed(0)
    T, d, eps = 5, 16, 1e-5
    blocks = [torch.randn(T, d, dtype=DT) * (i + 1) for i in range(3)]
    partial = torch.randn(T, d, dtype=DT)
    wn, wp = torch.rand(d, dtype=DT) + 0.5, torch.randn(1, d, dtype=DT)
    out = attn_res(partial, blocks, wn, wp, eps)
    for t in range(T):
        cands = [b[t] for b in blocks] + [partial[t]]
        s = [sum(v[j] / math.sqrt((v * v).mean().item() + eps) * wn[j] * wp[0, j] for j in range(d)) for v in cands]
        a = torch.softmax(torch.stack(s), 0)
        torch.testing.assert_close(out[t], sum(ai * v for ai, v in zip(a, cands)))
    assert attn_res(partial, [], wn, wp, eps) is partial


@pytest.mark.parametrize("preset", ["kimi_linear", "k3"])
def test_bf16_experts_keep_gate_and_up_apart_with_the_fused_bits(preset, monkeypatch):
    """fuse_weights leaves 16-bit CPU experts' w1 and w3 (and the shared experts' gate and up)
    apart, with no copy; the outputs are those of the fused weights bit for bit, for one token and
    for batches."""
    config = tiny_k3(num_experts=8, top_k=3) if preset == "k3" else tiny_kimi_linear(num_experts=8, top_k=3)
    apart = init_weights(KimiMoE(config), seed=21).to(torch.bfloat16)
    fused = copy.deepcopy(apart)
    w1 = apart.experts.w1.data_ptr()
    _fuse(apart)
    assert apart.experts.w13 is None and apart.experts.w1.data_ptr() == w1 and apart.shared_experts.gate_up is None
    monkeypatch.setattr(layers, "APART_DTYPES", ())
    _fuse(fused)
    assert fused.experts.w13 is not None and fused.shared_experts.gate_up is not None
    gen = torch.Generator().manual_seed(22)
    with torch.inference_mode():
        for T in (1, 3, 17, 600):
            x = torch.randn(T, config.hidden_size, generator=gen).to(torch.bfloat16)
            assert torch.equal(apart(x), fused(x)), T
