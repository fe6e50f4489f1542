"""MoE routing and experts, SiTU, and Block AttnRes against per-token references written from the spec."""

from __future__ import annotations

import math

import torch

from tidal.config import ModelConfig
from tidal.model.attn_res import attn_res
from tidal.model.init import init_weights
from tidal.model.moe import KimiMoE
from tidal.ops.activation import situ, swiglu
from tidal.presets import tiny_k3_dict, tiny_kimi_linear_dict

DT = torch.float64


def _moe(config_dict: dict, seed: int) -> KimiMoE:
    config = ModelConfig.from_dict(config_dict)
    moe = init_weights(KimiMoE(config), seed=seed).to(DT)
    with torch.no_grad():  # a bias large enough to change choices, so "bias only chooses" is tested
        moe.gate.e_score_correction_bias.copy_(torch.randn(config.num_experts, dtype=DT) * 0.3)
    return moe


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
