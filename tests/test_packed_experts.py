"""Packed MXFP4 routed experts end to end: the loader keeps them packed (dtype, bytes, peak RSS in a
fresh process), a dense checkpoint is packed with tidal quantize's rounding, and a packed engine's
greedy tokens equal the dequantised engine's on the embedded model, alone and in a batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tidal import LLM, SamplingParams
from tidal.embedded import embedded_model_dir
from tidal.model.checkpoint import MXFP4, load_model, save_model
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.model.moe import Experts, PackedExperts
from tidal.ops.mxfp import dequantize_mxfp4, quantize_mxfp4
from tidal.plan import weight_bytes
from tidal.presets import tiny_k3


def experts_of(model: KimiForCausalLM) -> list:
    return [layer.block_sparse_moe.experts for layer in model.model.layers
            if hasattr(getattr(layer, "block_sparse_moe", None), "experts")]


def model_bytes(model: KimiForCausalLM) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def test_loader_keeps_experts_packed_and_planner_counts_them():
    d = embedded_model_dir()
    dense = load_model(d, torch.bfloat16)
    packed = load_model(d, torch.bfloat16, quantization="mxfp4")
    c = packed.config
    E, I, de = c.num_experts, c.moe_intermediate_size, c.expert_hidden_size
    for pe, de_ in zip(experts_of(packed), experts_of(dense)):
        assert isinstance(pe, PackedExperts) and isinstance(de_, Experts)
        assert all(b.dtype == torch.uint8 for b in pe.buffers()) and not list(pe.parameters())
        assert sum(b.nbytes for b in pe.buffers()) == E * (3 * I * de // 2 + 3 * I * de // 32)
        w13 = dequantize_mxfp4(pe.stacked("w13_weight_packed"), pe.stacked("w13_weight_scale"), torch.bfloat16)
        assert torch.equal(w13, torch.cat([de_.w1, de_.w3], dim=1))
        w2 = dequantize_mxfp4(pe.stacked("w2_weight_packed"), pe.stacked("w2_weight_scale"), torch.bfloat16)
        assert torch.equal(w2, de_.w2)
    # the resident bytes are the planner's (4.25 bits an expert weight; the planner counts K3's
    # float32-on-disk convs and norms at 4 bytes, the bf16 model holds them in 2), dense ones far more
    assert 0.99 * weight_bytes(c) <= model_bytes(packed) <= weight_bytes(c)
    assert model_bytes(dense) > weight_bytes(c) * 1.5


def test_dense_checkpoint_packed_at_load_as_tidal_quantize_rounds(tmp_path):
    torch.manual_seed(0)
    model = init_weights(KimiForCausalLM(tiny_k3(mxfp4=False)), seed=1).eval()
    save_model(model, tmp_path / "dense")
    packed = load_model(tmp_path / "dense", torch.float32, quantization="mxfp4")
    for pe, src in zip(experts_of(packed), experts_of(model)):
        p1, s1 = quantize_mxfp4(src.w1.detach().float())
        I = src.w1.shape[1]
        assert torch.equal(pe.w13_weight_packed[:, :I], p1) and torch.equal(pe.w13_weight_scale[:, :I], s1)
        assert torch.equal(pe.w2_weight_packed, quantize_mxfp4(src.w2.detach().float())[0])
    # written back in MXFP4 as they are, and loaded again bit for bit
    save_model(packed, tmp_path / "mx", expert_format=MXFP4)
    again = load_model(tmp_path / "mx", torch.float32, quantization="mxfp4")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), packed.state_dict().values()))
    # implied by the checkpoint
    assert json.loads((tmp_path / "mx" / "config.json").read_text())["text_config"]["quantization_config"]
    llm = LLM(str(tmp_path / "mx"), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
    assert all(isinstance(e, PackedExperts) for e in experts_of(llm.engine.model))
    with pytest.raises(ValueError, match="quantization 'fp8' is not supported"):
        LLM(str(tmp_path / "mx"), skip_tokenizer_init=True, quantization="fp8")


RSS_SCRIPT = """
import gc, sys, torch
from tidal.model.checkpoint import load_model
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
# A first load of a tiny checkpoint: torch's one-time imports (torch._dynamo for meta tensors, ~75 MB)
# and the pages of library code a load runs (~4 MB) are resident before the baseline; then the
# garbage is freed now, not by a collection during the load (which would credit the load with memory
# that was never its own).
del_ = load_model(sys.argv[3], torch.bfloat16, quantization=sys.argv[2] or None)
del del_
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
base = status("VmRSS:")
m = load_model(sys.argv[1], torch.bfloat16, quantization=sys.argv[2] or None)
print(status("VmHWM:") - base)
"""


def test_load_peak_rss_within_1_2x_of_the_tensor_bytes(tmp_path):
    """Peak RSS during load, over the process's RSS after a first load of a tiny checkpoint, on a model
    whose experts dominate: packed (the experts in the file's mapping) <= 1.2x the tensor bytes; the
    dequantised load (the check can fail) is far above."""
    from tidal.config import ModelConfig
    from tidal.presets import tiny_k3, tiny_k3_dict

    d = tiny_k3_dict(hidden_size=256, num_layers=3, num_experts=64, top_k=2)
    d["text_config"].update(moe_intermediate_size=512, routed_expert_hidden_size=256)
    config = ModelConfig.from_dict(d)
    net = init_weights(KimiForCausalLM(config), seed=0).to_dtype(torch.bfloat16)
    save_model(net, tmp_path / "big", expert_format=MXFP4)
    del net
    save_model(init_weights(KimiForCausalLM(tiny_k3()), seed=0), tmp_path / "tiny", expert_format=MXFP4)
    tensor_bytes = weight_bytes(config)

    def extra_rss(quantization: str) -> int:
        run = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "big"), quantization,
                              str(tmp_path / "tiny")], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return int(run.stdout.split()[-1])

    assert extra_rss("mxfp4") <= 1.2 * tensor_bytes
    assert extra_rss("") > 2 * tensor_bytes


def test_packed_engine_greedy_equals_dequantised_engine_on_embedded_model():
    d = embedded_model_dir()
    prompts = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9], [42] * 6, list(range(30, 60))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    dense = LLM(load_model(d, torch.float32), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    packed = LLM(str(d), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    assert all(isinstance(e, PackedExperts) for e in experts_of(packed.engine.model))
    want = [o.outputs[0].token_ids for o in dense.generate([{"prompt_token_ids": p} for p in prompts], params)]
    batch = [o.outputs[0].token_ids for o in packed.generate([{"prompt_token_ids": p} for p in prompts], params)]
    alone = [packed.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    assert batch == want and alone == want


def test_mxfp4_checkpoint_experts_stay_in_the_file_mapping(tmp_path):
    """An MXFP4 checkpoint with 12 experts (the file holds them in the names' order 0, 1, 10, 11, 2,
    ...; each expert's w1, w2, w3 one after the other), sharded: every PackedExperts holds each
    expert's codes and scales as views of the file's mapping, through the serving prep too; the
    state_dict equals a copying load's; greedy tokens and prompt logprobs of a batch mixing prefills
    and decodes, and of a lone request, equal the copying load's; a mapped scale byte 255 is refused
    naming the tensor and its file."""
    from safetensors.torch import load_file, save_file

    from memory_maps import mapped_ranges
    from tidal.model.checkpoint import CheckpointError
    from tidal.presets import tiny_k3

    torch.manual_seed(0)
    config = tiny_k3(num_experts=12)
    save_model(init_weights(KimiForCausalLM(config), seed=3), tmp_path, expert_format=MXFP4, max_shard_bytes=64 << 10)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 2
    mapped = load_model(tmp_path, torch.float32, quantization="mxfp4")
    copied = load_model(tmp_path, torch.float32, quantization="mxfp4", use_mmap=False)
    m, c = mapped.state_dict(), copied.state_dict()
    assert m.keys() == c.keys() and all(torch.equal(m[k], c[k]) for k in m)

    def in_file(experts: list) -> bool:
        ranges = mapped_ranges(files)
        return all(any(lo <= t.data_ptr() < hi for lo, hi in ranges)
                   for x in experts for leaf in ("w1", "w2", "w3") for e in range(12) for t in x.expert_matrices(leaf, e))

    assert all(x.apart for x in experts_of(mapped)) and in_file(experts_of(mapped))
    assert not any(x.apart for x in experts_of(copied))
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(3)] + [{"prompt_token_ids": [9]}]
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0)
    outs = {}
    for strategy in ("lazy", "eager"):
        llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20,
                  safetensors_load_strategy=strategy, max_num_batched_tokens=48)
        served = experts_of(llm.engine.model)
        assert all(x.apart == (strategy == "lazy") for x in served)
        if strategy == "lazy":
            assert in_file(served)
        outs[strategy] = [(o.outputs[0].token_ids, o.prompt_logprobs)
                          for o in [*llm.generate(prompts, params), *llm.generate(prompts[1:2], params)]]
        del llm
    assert outs["lazy"] == outs["eager"]
    scale = "language_model.model.layers.1.block_sparse_moe.experts.10.w3.weight_scale"
    file = next(f for f in files if scale in load_file(f))
    tensors = load_file(file)
    tensors[scale][2, 0] = 255
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{scale}.*{file.name}.*255"):
        load_model(tmp_path, torch.float32, quantization="mxfp4")
