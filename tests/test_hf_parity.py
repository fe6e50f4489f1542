"""Against an independent peer: transformers' own kimi_linear on the same saved checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tidal.config import ModelConfig
from tidal.model.checkpoint import load_model, save_model
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.presets import tiny_kimi_linear_dict

transformers = pytest.importorskip("transformers")


def no_triton() -> None:
    try:
        import triton  # noqa: F401

        pytest.fail("triton is installed: transformers would pick GPU kernels and crash on CPU")
    except ImportError:
        pass


def tiny_config() -> ModelConfig:
    d = tiny_kimi_linear_dict(num_layers=5, num_experts=8, top_k=2)
    d["torch_dtype"] = "float32"
    return ModelConfig.from_dict(d)


def assert_logits_match(ours: KimiForCausalLM, theirs, config: ModelConfig) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, 90))  # > 64 tokens: their chunked KDA path
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits[0].float()
        cache = SimpleCache(config, 1, torch.float32)
        got = ours.compute_logits(ours(ids[0], simple_batch(config, [ids.shape[1]], cache, [0])))
    assert ref.std() > 1e-2
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-4, f"relative difference {rel:.2e}"
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_logits_match_transformers_kimi_linear(tmp_path):
    no_triton()
    config = tiny_config()
    save_model(init_weights(KimiForCausalLM(config), seed=11), tmp_path, expert_format=None)
    ours = load_model(tmp_path, dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert_logits_match(ours, theirs, config)


def test_checkpoint_saved_by_transformers_loads(tmp_path):
    """tidal save -> transformers from_pretrained -> save_pretrained -> tidal load: the checkpoint
    transformers writes (its own tensor names) loads, with the same weights and transformers' logits."""
    no_triton()
    config = tiny_config()
    model = init_weights(KimiForCausalLM(config), seed=12)
    save_model(model, tmp_path / "tidal", expert_format=None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tidal"), dtype=torch.float32).eval()
    theirs.save_pretrained(str(tmp_path / "hf"))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in written  # transformers' spelling
    assert "model.layers.0.mlp.gate_proj.weight" not in written

    ours = load_model(tmp_path / "hf", dtype=torch.float32)
    want = model.state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, want[name]), name
    assert_logits_match(ours, theirs, config)
