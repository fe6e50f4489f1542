"""--enable-deterministic-inference: in bfloat16 a request's greedy tokens, and the log-probabilities
they were chosen with, are bitwise the same alone, in a mixed batch, under any chunk size, after a
prefix-cache hit and after preemption (tidal.ops.batch_invariant); and the row-invariant ops agree
with the plain ones within bf16 rounding."""

from __future__ import annotations

import random

import pytest
import torch

from tidal import SamplingParams
from tidal.engine.core import EngineConfig, EngineCore
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.ops import batch_invariant
from tidal.plan import pool_layout
from tidal.presets import tiny_k3

PAGE = 4


@pytest.fixture(scope="module")
def model() -> KimiForCausalLM:
    return init_weights(KimiForCausalLM(tiny_k3()), seed=0).to_dtype(torch.bfloat16).eval()


def make_engine(model, *, blocks: int = 64, budget: int = 2048, **kw) -> EngineCore:
    block = pool_layout(model.config, 1 << 30, page_size=PAGE, kv_dtype_bytes=2, conv_dtype_bytes=2).block_bytes
    return EngineCore(model, EngineConfig(max_num_batched_tokens=budget, page_size=PAGE,
                                          kv_cache_memory_bytes=blocks * block, **kw))


def drive(engine: EngineCore, jobs: list[tuple[int, list[int], SamplingParams]]) -> list[tuple[list[int], float]]:
    """Add job i (arrival step, prompt, params) at its step; run to the end -> (tokens, cumulative
    logprob) of each job."""
    results: dict[str, tuple[list[int], float]] = {}
    pending = sorted(enumerate(jobs), key=lambda j: j[1][0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].cumulative_logprob)
        step += 1
    return [results[str(i)] for i in range(len(jobs))]


def workload(seed: int, count: int) -> list[tuple[int, list[int], SamplingParams]]:
    """Prompts of 1..40 tokens; the odd ones extend the 24 tokens of the first odd one, whose
    prompt-end snapshot they hit; greedy."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 250) for _ in range(24)]
    jobs = []
    for i in range(count):
        tail = [rng.randrange(1, 250) for _ in range(rng.randint(1, 16))]
        prompt = (shared if i == 1 else shared + tail) if i % 2 else [rng.randrange(1, 250) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(4, 12), ignore_eos=True, logprobs=1)
        jobs.append((i // 3, prompt, params))
    return jobs


def test_bf16_greedy_is_bitwise_batch_chunk_prefix_and_preemption_invariant(model):
    jobs = workload(1, 12)  # its request 10 caught vector-vs-scalar exp rounding in AttnRes
    solo = [drive(make_engine(model, enable_deterministic_inference=True, enable_prefix_caching=False),
                  [(0, p, sp)])[0] for _, p, sp in jobs]
    for budget in (2048, 7):  # whole prompts; chunks of 7 tokens across requests
        engine = make_engine(model, budget=budget, enable_deterministic_inference=True, prefix_snapshot_interval=8)
        assert drive(engine, jobs) == solo, budget
        assert engine.metrics().prefix_cache_hits > 0  # the later shared-prefix prompts hit the cache
    tight = make_engine(model, blocks=3, budget=5, enable_deterministic_inference=True)
    assert drive(tight, [(0, p, sp) for _, p, sp in jobs]) == solo
    assert tight.metrics().num_preemptions > 0


def test_without_the_flag_the_same_workload_is_not_bitwise_invariant(model):
    """The check above can fail: by default bf16 matmuls block by the row count, and chunked
    prefill computes tokens differently, so some requests' log-probabilities change."""
    jobs = workload(0, 10)
    solo = [drive(make_engine(model, enable_prefix_caching=False), [(0, p, sp)])[0] for _, p, sp in jobs]
    got = drive(make_engine(model, budget=7, prefix_snapshot_interval=8), jobs)
    assert any(g[1] != s[1] for g, s in zip(got, solo))


def test_the_mode_is_per_thread_and_restored(model):
    assert not batch_invariant.enabled()
    with batch_invariant.deterministic_mode():
        assert batch_invariant.enabled()
        with batch_invariant.deterministic_mode(False):
            assert not batch_invariant.enabled()
        assert batch_invariant.enabled()
    assert not batch_invariant.enabled()


def test_row_invariant_forward_is_the_model_within_bf16_rounding(model):
    """The deterministic ops compute the same function: the whole model's logits on a prefill and
    a decode step agree with the default ops' within bfloat16 noise."""
    torch.manual_seed(1)
    ids = torch.randint(1, 250, (30,))

    def logits(on: bool) -> torch.Tensor:
        cache = SimpleCache(model.config, 1, torch.bfloat16)
        with torch.inference_mode(), batch_invariant.deterministic_mode(on):
            h = model(ids[:-1], simple_batch(model.config, [29], cache, [0]))
            h2 = model(ids[-1:], simple_batch(model.config, [1], cache, [29]))
            return model.compute_logits(torch.cat([h[-1:], h2]))

    plain, fixed = logits(False), logits(True)
    spread = plain.std()
    assert (plain - fixed).abs().max() < 0.1 * spread, ((plain - fixed).abs().max(), spread)


def test_row_invariant_linear_is_bitwise_row_invariant_and_close_to_float64():
    torch.manual_seed(2)
    w = torch.randn(96, 200).to(torch.bfloat16)
    x = torch.randn(37, 200).to(torch.bfloat16)
    with batch_invariant.deterministic_mode():
        whole = batch_invariant.linear(x, w)
        rows = torch.cat([batch_invariant.linear(x[i : i + 1], w) for i in range(37)])
        router = batch_invariant.linear(x.float(), w)  # float32 rows, bf16 weight: float32 out
    assert torch.equal(whole, rows)
    exact = x.double() @ w.double().t()
    assert router.dtype == torch.float32 and torch.allclose(router.double(), exact, atol=1e-4, rtol=1e-5)
    assert torch.allclose(whole.double(), exact, atol=0.05, rtol=1e-2)


def test_refused_where_it_cannot_hold(model, monkeypatch):
    with pytest.raises(ValueError, match="CPU only"):
        batch_invariant.check_available(torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="float16"):
        batch_invariant.check_available(torch.device("cpu"), torch.float16)
    monkeypatch.setattr(batch_invariant, "bf16_gemm_kernel", lambda: None)
    with pytest.raises(ValueError, match="bf16_gemm"):
        make_engine(model, enable_deterministic_inference=True)
