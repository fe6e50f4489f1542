"""A bfloat16 model's whole decode step in one C call (csrc/model_decode.c through
tidal.ops.fused_decode.model_decode_step): the bits of the layers' one-call steps and glue it
replaces (log-probabilities equal, not close), batched and alone, and the cases it leaves to them."""

from __future__ import annotations

import pytest
import torch

from tidal import LLM, SamplingParams
from tidal.embedded import embedded_model_dir
from tidal.ops import fused_decode

from test_mla_layer_step import count_calls

PROMPTS = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9], [42] * 6, list(range(30, 60))]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(embedded_model_dir()), dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24,
               enable_prefix_caching=False)


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def counting(monkeypatch) -> list[bool]:
    return count_calls(monkeypatch, "model_decode_step")


def test_one_call_step_has_the_bits_of_the_layer_steps(llm, monkeypatch):
    calls = counting(monkeypatch)
    on = run(llm, PROMPTS)
    assert calls and all(calls)  # every decode step of the batch ran as one call
    alone_on = [run(llm, [p])[0] for p in PROMPTS]
    monkeypatch.setattr(fused_decode, "model_decode_step", lambda *args: None)
    layer_calls = []
    real = fused_decode.kda_layer_step
    monkeypatch.setattr(fused_decode, "kda_layer_step", lambda *a: layer_calls.append(1) or real(*a))
    off = run(llm, PROMPTS)
    alone_off = [run(llm, [p])[0] for p in PROMPTS]
    assert layer_calls  # the layers' own steps ran instead
    assert on == off and alone_on == alone_off
    assert [a[0] for a in alone_on] == [o[0] for o in on]  # greedy tokens do not depend on the batch


def test_it_steps_aside_where_it_does_not_apply(llm, monkeypatch):
    """Under batch invariance, and for a float32 model, the step runs layer by layer."""
    from tidal.ops import batch_invariant

    calls = counting(monkeypatch)
    with batch_invariant.deterministic_mode(True):
        h = torch.zeros(1, 256, dtype=torch.bfloat16)
        plan = llm.engine.worker.runner.model.model._model_step_plan()
        assert plan
        assert fused_decode.model_decode_step(plan, h, torch.zeros(1, dtype=torch.int32), [], [], None, None, None) is None
    f32 = LLM(str(embedded_model_dir()), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    assert f32.engine.worker.runner.model.model._model_step_plan() is False
    calls.clear()
    run(f32, PROMPTS[:1])
    assert not calls
