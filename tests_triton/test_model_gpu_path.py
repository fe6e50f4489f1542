"""The model's GPU path end to end on the CPU: with the interpreter on, ``use_triton`` holds for CPU
tensors, so the engine's steps run the Triton MLA decode and prefill, grouped expert and conv
kernels (KDA's recurrence stays on the torch path: fla's kernels need a GPU). Greedy output must
equal the torch reference's."""

from __future__ import annotations

import contextlib
import inspect
import sys
from pathlib import Path
from unittest import mock

import pytest

from tidal.engine.core import EngineConfig, EngineCore
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.model.moe import pack_experts
from tidal.ops.triton import mla_decode, moe, prefill_attention, short_conv
from tidal.plan import pool_layout
from tidal.presets import tiny_k3, tiny_kimi_linear
from tidal.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_engine  # noqa: E402

PAGE = 4


def reference_greedy(model: KimiForCausalLM, prompt: list[int], n: int) -> list[int]:
    """The main suite's engine-free reference (torch kernels only), with the Triton paths off."""
    with mock.patch("tidal.ops.triton.interpreting", return_value=False):
        return test_engine.reference_greedy(model, prompt, n)


@pytest.mark.parametrize("name", ["k3_mxfp4", "kimi_linear"])
def test_engine_on_triton_kernels_matches_reference(name):
    """K3 with packed MXFP4 experts (both models pack the same quantised weights), Kimi Linear dense."""
    cfg = tiny_k3() if name == "k3_mxfp4" else tiny_kimi_linear()
    reference = init_weights(KimiForCausalLM(cfg), seed=0).eval()
    model = init_weights(KimiForCausalLM(cfg), seed=0).eval()
    if name == "k3_mxfp4":
        pack_experts(reference)
        pack_experts(model)
    block = pool_layout(cfg, 1 << 30, page_size=PAGE, kv_dtype_bytes=4, conv_dtype_bytes=4).block_bytes
    engine = EngineCore(model, EngineConfig(page_size=PAGE, kv_cache_memory_bytes=32 * block,
                                            enable_prefix_caching=False))
    prompts = [[5, 17, 99, 3, 42, 7, 8], [1, 2], [30 + i for i in range(10)]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    results = {}
    kernels = [mla_decode.mla_decode_attention, prefill_attention.flash_attention_tile, moe.fused_experts,
               short_conv.conv_step_]
    with contextlib.ExitStack() as stack:
        spies = [stack.enter_context(mock.patch.object(inspect.getmodule(k), k.__name__, wraps=k)) for k in kernels]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.outputs[0].token_ids
    assert all(spy.called for spy in spies)  # the steps did run the Triton kernels
    for i, p in enumerate(prompts):
        assert results[str(i)] == reference_greedy(reference, p, 3), f"prompt {i}"
