"""Whole-model consistency: one prefill == token-by-token decode with the cache == a varlen batch."""

from __future__ import annotations

import pytest
import torch

from tidal.config import ModelConfig
from tidal.model.checkpoint import load_model, save_model
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.ops.mxfp import fake_quantize_mxfp4
from tidal.presets import tiny_k3_dict, tiny_kimi_linear_dict

DT = torch.float64


def prefill_logits(model: KimiForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    cache = SimpleCache(model.config, 1, DT)
    hidden = model(ids, simple_batch(model.config, [len(ids)], cache, [0]))
    return model.compute_logits(hidden)


def decode_logits(model: KimiForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    cache = SimpleCache(model.config, 1, DT)
    rows = []
    for t in range(len(ids)):
        hidden = model(ids[t : t + 1], simple_batch(model.config, [1], cache, [t]))
        rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


def chunked_logits(model: KimiForCausalLM, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    cache = SimpleCache(model.config, 1, DT)
    rows = []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        hidden = model(piece, simple_batch(model.config, [len(piece)], cache, [start]))
        rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


def saved_and_loaded(tmp_path, config_dict: dict, expert_format: str | None, seed: int) -> KimiForCausalLM:
    """Build a random model, write it in the checkpoint layout, load it back in float64."""
    config = ModelConfig.from_dict(config_dict)
    model = init_weights(KimiForCausalLM(config), seed=seed)
    save_model(model, tmp_path / "ckpt", expert_format=expert_format)
    return load_model(tmp_path / "ckpt", dtype=DT)


CASES = {
    # K3: AttnRes with 3 blocks (6 layers, block 2), latent MoE + SiTU, gated q-LoRA MLA, MXFP4 experts
    "k3-mxfp4": (tiny_k3_dict(num_layers=6, attn_res_block_size=2), "mxfp4-pack-quantized"),
    "k3-attnres-uneven": (tiny_k3_dict(num_layers=5, attn_res_block_size=3, mxfp4=False), None),
    "kimi-linear": (tiny_kimi_linear_dict(num_layers=4), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_equals_decode_and_chunks(tmp_path, case):
    config_dict, fmt = CASES[case]
    model = saved_and_loaded(tmp_path, config_dict, fmt, seed=hash(case) % 1000)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (70,))
    full = prefill_logits(model, ids)
    assert torch.isfinite(full).all()
    assert full.std() > 1e-3  # a model whose logits are flat would make every comparison vacuous
    torch.testing.assert_close(decode_logits(model, ids), full, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(chunked_logits(model, ids, 17), full, rtol=1e-9, atol=1e-9)


def test_varlen_batch_equals_each_alone(tmp_path):
    config_dict, fmt = CASES["k3-mxfp4"]
    model = saved_and_loaded(tmp_path, config_dict, fmt, seed=3)
    config = model.config
    torch.manual_seed(2)
    prompts = [torch.randint(0, config.vocab_size, (n,)) for n in (9, 1, 23)]
    alone = [prefill_logits(model, p) for p in prompts]
    # One step prefilling all three, then one decode step for all three together.
    cache = SimpleCache(config, 3, DT)
    lens = [len(p) for p in prompts]
    hidden = model(torch.cat(prompts), simple_batch(config, lens, cache, [0, 0, 0]))
    logits = model.compute_logits(hidden)
    for b, ref in enumerate(alone):
        start = sum(lens[:b])
        torch.testing.assert_close(logits[start : start + lens[b]], ref, rtol=1e-9, atol=1e-9)
    nxt = torch.tensor([5, 6, 7])
    step = model.compute_logits(model(nxt, simple_batch(config, [1, 1, 1], cache, lens)))
    for b, p in enumerate(prompts):
        ref = prefill_logits(model, torch.cat([p, nxt[b : b + 1]]))[-1]
        torch.testing.assert_close(step[b], ref, rtol=1e-9, atol=1e-9)


def test_mxfp4_checkpoint_runs_the_fake_quantised_twin(tmp_path):
    """An MXFP4 checkpoint computes exactly what the dense model computes with its experts rounded to
    MXFP4 in memory, and differs from the unrounded model (so quantisation really happened)."""
    config = ModelConfig.from_dict(tiny_k3_dict(num_layers=6, attn_res_block_size=2, mxfp4=False))
    model = init_weights(KimiForCausalLM(config), seed=5)
    save_model(model, tmp_path / "q", expert_format="mxfp4-pack-quantized")
    loaded = load_model(tmp_path / "q", dtype=DT)
    dense = model.to(DT)
    ids = torch.arange(20) % config.vocab_size
    with torch.no_grad():
        before = prefill_logits(dense, ids)
        for name, p in dense.named_parameters():
            if ".experts." in name:
                p.copy_(fake_quantize_mxfp4(p))
        twin = prefill_logits(dense, ids)
        got = prefill_logits(loaded, ids)
    torch.testing.assert_close(got, twin, rtol=1e-12, atol=1e-12)
    assert (got - before).abs().max() > 1e-3


@pytest.mark.parametrize("preset", ["k3", "kimi_linear"])
def test_prepared_weights_give_the_same_logits_and_follow_later_changes(preset):
    """process_weights_after_loading (fused projections, input-major layout) keeps the state dict and
    the logits; a weight replaced afterwards (new storage, or a cast) is used, never the stale
    fused copy."""
    from tidal.presets import tiny_k3, tiny_kimi_linear

    config = tiny_k3() if preset == "k3" else tiny_kimi_linear()
    plain = init_weights(KimiForCausalLM(config), seed=21).eval()
    prepared = init_weights(KimiForCausalLM(config), seed=21).eval().process_weights_after_loading()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), prepared.state_dict().values()))
    ids = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(2))

    def logits(model: KimiForCausalLM) -> torch.Tensor:
        with torch.inference_mode():
            cache = SimpleCache(config, 1, model.dtype)
            return model.compute_logits(model(ids, simple_batch(config, [9], cache, [0])))

    torch.testing.assert_close(logits(prepared), logits(plain), rtol=1e-4, atol=1e-4)
    for model in (plain, prepared):  # new storage for one fused projection of each attention kind
        for layer in model.model.layers:
            attn = layer.self_attn
            w = attn.kv_a_proj_with_mqa.weight if hasattr(attn, "kv_a_proj_with_mqa") else attn.k_proj.weight
            w.data = torch.full_like(w.contiguous(), 0.01)
    torch.testing.assert_close(logits(prepared), logits(plain), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits(prepared.to_dtype(torch.float64)), logits(plain.to_dtype(torch.float64)),
                               rtol=1e-10, atol=1e-10)
