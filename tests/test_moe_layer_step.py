"""The bfloat16 MoE layer with packed MXFP4 experts in one C call (csrc/moe_layer_decode.c through
tidal.ops.fused_decode.moe_layer_step): the bits of the separate calls it replaces, a row's bits
independent of the other rows and the thread count, and the float64 layer within the bfloat16
roundings of the intermediates the model holds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tidal.model.moe import KimiMoE, PackedExperts
from tidal.ops import cpu_kernels, fused_decode
from tidal.ops.mxfp import dequantize_mxfp4
from tidal.presets import tiny_k3

from test_fused_decode import one_call_variants


@pytest.fixture(autouse=True)
def kernels_built():
    if cpu_kernels.moe_layer_step_kernels() is None:
        pytest.skip("no C compiler here: the separate calls run")


def bf16_moe(config, seed: int, router_dtype: torch.dtype = torch.bfloat16) -> KimiMoE:
    """A KimiMoE as a bfloat16 load leaves it: bf16 trunk weights, float32 correction bias, packed experts."""
    torch.manual_seed(seed)
    moe = KimiMoE(config)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.data.normal_(0.0, 2.0 * p.shape[-1] ** -0.5)
            if name == "gate.e_score_correction_bias":
                p.data.mul_(0.05)
            elif name.endswith("norm.weight"):
                p.data.add_(1.0)
        moe.experts = PackedExperts.from_dense(moe.experts)
        for name, p in moe.named_parameters():
            if name != "gate.e_score_correction_bias":
                p.data = p.data.to(router_dtype if name == "gate.weight" else torch.bfloat16)
    return moe


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def reference_act(config, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if config.hidden_act == "situ":
        b, lb = config.situ_beta, config.situ_linear_beta
        return torch.tanh(g / b) * b * torch.sigmoid(g) * (torch.tanh(u / lb) * lb)
    return torch.nn.functional.silu(g) * u


def reference_layer(moe: KimiMoE, x: torch.Tensor) -> torch.Tensor:
    """KimiMoE.forward in float64, rounded to bfloat16 where the model holds a bfloat16 tensor."""
    c = moe.config
    xd = x.double()
    scores = torch.sigmoid(xd @ moe.gate.weight.double().t())
    ids = (scores + moe.gate.e_score_correction_bias.double()).topk(c.num_experts_per_token, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
    h = bf16(xd @ moe.routed_expert_down_proj.weight.double().t()) if c.is_latent_moe else xd
    deq = {leaf: [dequantize_mxfp4(*moe.experts.expert_matrices(leaf, e), torch.float64) for e in range(c.num_experts)]
           for leaf in ("w1", "w3", "w2")}
    y = torch.zeros_like(h)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            a = reference_act(c, deq["w1"][e] @ h[t], deq["w3"][e] @ h[t])
            y[t] += w[t, j] * (deq["w2"][e] @ a)
    y = bf16(y)
    if c.is_latent_moe:
        if c.latent_moe_use_norm:
            norm = moe.routed_expert_norm
            y = bf16(y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double())
        y = bf16(y @ moe.routed_expert_up_proj.weight.double().t())
    if c.num_shared_experts:
        s = moe.shared_experts
        g, u = bf16(xd @ s.gate_proj.weight.double().t()), bf16(xd @ s.up_proj.weight.double().t())
        y = y + bf16(bf16(reference_act(c, g, u)) @ s.down_proj.weight.double().t())
    return y


CONFIGS = {
    "k3 latent": dict(),
    # more experts, wider: past a few rows the branches run one after the other (the k3 one's side by side)
    "swiglu, no norm, fp32 router": dict(hidden_act="swiglu", latent_moe_use_norm=False, num_experts=24,
                                         moe_intermediate_size=64),
    "no latent, no shared": dict(routed_expert_hidden_size=None, num_shared_experts=0),
}


@pytest.mark.parametrize("amx", [0, 1])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_layer_step_has_the_bits_of_the_separate_calls_and_matches_float64(monkeypatch, name, amx):
    """On fresh random rows (1, 2, 5 and FUSED_MAX_ROWS of them, at a row stride): the one call ==
    the separate calls, a row alone == in the batch, 1 thread == 2 (whichever way the branches
    run), bitwise; within the bfloat16 roundings of the float64 layer; more rows run the separate
    calls. The bf16 products on the FMA tiles (amx 0) and on the AMX tiles at every row count (amx 1)."""
    with cpu_kernels.amx_rows(amx) as in_force:
        if in_force != amx:
            pytest.skip("no AMX-BF16 tiles on this CPU")
        moe_layer_step_against_separate_calls(monkeypatch, name)


def moe_layer_step_against_separate_calls(monkeypatch, name) -> None:
    config = replace(tiny_k3(hidden_size=96, num_experts=12, top_k=3), **CONFIGS[name])
    moe = bf16_moe(config, seed=41, router_dtype=torch.float32 if "fp32" in name else torch.bfloat16)
    calls = []
    real = fused_decode.moe_layer_step
    monkeypatch.setattr(fused_decode, "moe_layer_step", lambda *a: calls.append(real(*a) is not None) or real(*a))
    gen = torch.Generator().manual_seed(42)
    d = config.hidden_size
    for T in (1, 2, 5, fused_decode.FUSED_MAX_ROWS):
        x = torch.randn(T, d + 5, generator=gen).bfloat16()[:, 3 : 3 + d]
        got, alone, single, separate = one_call_variants(monkeypatch, moe, x, "moe_layer_step")
        assert calls and all(calls) and got.dtype == torch.bfloat16 and got.shape == (T, d)
        assert torch.equal(got, separate) and torch.equal(got, alone) and torch.equal(got, single)
        ref = reference_layer(moe, x)
        assert (got.double() - ref).abs().max() / ref.abs().max() < 0.03
    calls.clear()
    with torch.inference_mode():
        moe(torch.randn(fused_decode.FUSED_MAX_ROWS + 1, d, generator=gen).bfloat16())
    assert calls == [False]


def test_moe_layer_plan_follows_replaced_weights_and_declines_what_it_does_not_take():
    config = tiny_k3(hidden_size=64, num_experts=8, top_k=2)
    moe = bf16_moe(config, seed=43)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(44)).bfloat16()
    with torch.inference_mode():
        first = moe(x)
        plan = moe._step_plan()
        assert plan is not None and moe._step_plan() is plan
        moe.shared_experts.down_proj.weight.data = torch.zeros_like(moe.shared_experts.down_proj.weight)
        assert moe._step_plan() is not plan
        moe.routed_expert_up_proj.weight.data = torch.zeros_like(moe.routed_expert_up_proj.weight)
        assert torch.equal(moe(x), torch.zeros_like(first))
    moe.experts.local_experts = (0, 4)  # a rank's share of the experts: the separate calls
    assert moe._step_plan() is None
    float_moe = bf16_moe(config, seed=43)
    float_moe.shared_experts.float()  # a float32 shared expert: its MLP step does not take it
    assert float_moe._step_plan() is None
    plan = bf16_moe(config, seed=43)._step_plan()
    x32 = torch.randn(2, 64)
    assert fused_decode.moe_layer_step(plan, x32) is None  # float32 rows


def test_moe_layer_step_refuses_out_of_range_expert_ids_clearly():
    """A router weight with more experts than the tables: the plan declines it (no out-of-range read)."""
    config = tiny_k3(hidden_size=64, num_experts=8, top_k=2)
    moe = bf16_moe(config, seed=45)
    w13, w2 = moe.experts.tables()
    wide = torch.randn(16, 64).bfloat16()
    assert fused_decode.moe_layer_plan(wide, torch.zeros(16), 2, 1, 1, True, 1.0,
                                       (moe.routed_expert_down_proj.weight, moe.routed_expert_up_proj.weight),
                                       None, w13, w2, None, None) is None


def test_kernels_off_the_layer_runs_its_torch_form(monkeypatch):
    """TIDAL_CPU_KERNELS=0: no plan, and the layer's torch form still matches the float64 layer."""
    cached = (cpu_kernels._library, cpu_kernels.moe_layer_step_kernels, cpu_kernels.moe_router_kernel,
              cpu_kernels.mlp_step_kernels, cpu_kernels.rms_norm_kernel, cpu_kernels.mxfp4_moe_kernel,
              cpu_kernels.mxfp4_kernels, cpu_kernels.bf16_rows_kernel, cpu_kernels.bf16_parts_kernel)
    moe = bf16_moe(tiny_k3(hidden_size=64, num_experts=8, top_k=2), seed=46)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(47)).bfloat16()
    try:
        monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")
        for fn in cached:
            fn.cache_clear()
        assert moe._step_plan() is None
        with torch.inference_mode():
            got = moe(x)
    finally:
        monkeypatch.delenv("TIDAL_CPU_KERNELS")
        for fn in cached:
            fn.cache_clear()
    ref = reference_layer(moe, x)
    assert (got.double() - ref).abs().max() / ref.abs().max() < 0.03
