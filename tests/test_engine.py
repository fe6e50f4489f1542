"""EngineCore end to end on a tiny random K3 model (float32): batch invariance, seeded sampling,
overload with preemption, exact pool accounting, impossible requests, and the offline LLM API.

The tiny model's top-2 logits are not near-tied at the positions these tests visit: greedy outputs
matched bit for bit across batchings when written. If a model change makes a float32 rounding
difference flip an argmax, make the logits better separated (e.g. scale lm_head) or run in
float64 -- do not loosen the assertions.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

from tidal import LLM, SamplingParams
from tidal.engine.core import EngineConfig, EngineCore
from tidal.engine.request import RequestOutput, RequestTooLongError
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.plan import pool_layout
from tidal.presets import tiny_k3

PAGE = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The test machine's 2 cores are shared: OpenMP threads spinning against other processes
    # make tiny steps ~30x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model() -> KimiForCausalLM:
    torch.manual_seed(0)
    return init_weights(KimiForCausalLM(tiny_k3()), seed=0).eval()


def block_bytes(model: KimiForCausalLM) -> int:
    return pool_layout(model.config, 1 << 30, page_size=PAGE, kv_dtype_bytes=4, conv_dtype_bytes=4).block_bytes


def make_engine(model, *, blocks: int = 64, budget: int = 2048, **kw) -> EngineCore:
    cfg = EngineConfig(max_num_batched_tokens=budget, page_size=PAGE, kv_cache_memory_bytes=blocks * block_bytes(model),
                       **kw)
    return EngineCore(model, cfg)


def drive(engine: EngineCore, jobs: list[tuple[int, str, list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    """Add each job (arrival step, id, prompt, params) at its step; run until all finish."""
    results: dict[str, RequestOutput] = {}
    pending = sorted(jobs, key=lambda j: j[0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
    return results


def alone(model, prompt: list[int], params: SamplingParams) -> list[int]:
    return drive(make_engine(model), [(0, "x", prompt, params)])["x"].outputs[0].token_ids


@pytest.fixture(scope="module")
def reference_model() -> KimiForCausalLM:
    """The same weights as ``model``, never prepared by an engine (no fused or relaid-out weights)."""
    return init_weights(KimiForCausalLM(tiny_k3()), seed=0).eval()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Prefill then token-by-token decode over the reference SimpleCache, torch kernels only."""
    cache = SimpleCache(model.config, 1, torch.float32)
    out: list[int] = []
    ids, cached = list(prompt), 0
    with torch.inference_mode(), mock.patch("tidal.ops.kda.kda_decode_for", return_value=None):
        while len(out) < n:
            h = model(torch.tensor(ids), simple_batch(model.config, [len(ids)], cache, [cached]))
            cached += len(ids)
            ids = [int(model.compute_logits(h[-1:]).argmax())]
            out.append(ids[0])
    return out


def random_prompts(seed: int, count: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def test_batch_invariance_greedy(model, reference_model):
    rng = random.Random(1)
    prompts = random_prompts(1, 16, 40)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(3, 12), ignore_eos=True) for _ in prompts]
    solo = [alone(model, p, sp) for p, sp in zip(prompts, params)]
    for i in (0, 5):
        assert solo[i] == reference_greedy(reference_model, prompts[i], params[i].max_tokens)
    jobs = [(i // 3, str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for budget in (2048, 11, 3):  # whole prompts, chunked, tiny chunks
        got = drive(make_engine(model, budget=budget), jobs)
        assert [got[str(i)].outputs[0].token_ids for i in range(16)] == solo, budget


def test_seeded_sampling_alone_and_in_batch(model):
    prompts = random_prompts(2, 8, 20)
    seeded = [SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=100 + i, max_tokens=10, ignore_eos=True)
              for i in range(4)]
    solo = [alone(model, prompts[i], seeded[i]) for i in range(4)]
    assert len({tuple(s) for s in solo}) == 4
    noise = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    jobs = [(i % 3, str(i), prompts[i], seeded[i] if i < 4 else noise) for i in range(8)]
    got = drive(make_engine(model, budget=9), jobs)
    assert [got[str(i)].outputs[0].token_ids for i in range(4)] == solo


def test_overload_preempts_and_recomputes_exactly(model):
    prompts = random_prompts(3, 12, 12)
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    engine = make_engine(model, blocks=8)
    fits = engine.layout.max_requests(12 + 36)
    assert 1 <= fits <= 3  # so 12 requests are >= 4x what the pool holds
    got = drive(engine, [(0, str(i), p, params) for i, p in enumerate(prompts)])
    m = engine.metrics()
    assert m.num_preemptions > 0 and m.num_requests_aborted == 0 and m.num_requests_finished == 12
    for i, p in enumerate(prompts):
        out = got[str(i)].outputs[0]
        assert out.finish_reason == "length"
        assert out.token_ids == alone(model, p, params), i
    assert got["0"].metrics.num_preemptions == 0  # the oldest is never preempted


def test_pool_accounting_returns_to_start(model):
    engine = make_engine(model, blocks=7, budget=16)
    start = engine.pool.usage()
    assert start.free_pages == start.total_pages
    prompts = random_prompts(4, 14, 30)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=8 + i % 5 * 6, ignore_eos=True))
    aborted = 0
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if step in (3, 9, 20):  # abort the oldest running request and a waiting one
            running = engine.scheduler.running
            if running:
                victim = running[0].request_id
                held = engine.pool.free_pages
                assert engine.abort_request(victim).outputs[0].finish_reason == "abort"
                assert engine.pool.free_pages > held  # freed at once
                aborted += 1
            if engine.scheduler.waiting:
                assert engine.abort_request(engine.scheduler.waiting[-1].request_id) is not None
                aborted += 1
    m = engine.metrics()
    assert not engine.has_unfinished_requests()
    assert m.num_preemptions > 0 and m.num_requests_aborted == aborted >= 3
    assert m.num_requests_finished + aborted == 14
    assert engine.flush_prefix_cache()  # finished requests left their prefixes in the cache
    assert engine.pool.usage() == start


def test_impossible_requests_rejected_others_served(model):
    engine = make_engine(model, blocks=4, max_model_len=200)
    pool_limit = engine.layout.max_context_len()
    assert pool_limit < 200
    good = random_prompts(5, 3, 10)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for i, p in enumerate(good[:2]):
        engine.add_request(str(i), p, params)
    with pytest.raises(RequestTooLongError, match=rf"{pool_limit}") as e:
        engine.add_request("pool", [1] * (pool_limit - 4), params)
    assert f"{pool_limit + 1} tokens" in str(e.value)
    with pytest.raises(RequestTooLongError, match=r"= 210 tokens exceeds max_model_len \(200\)"):
        engine.add_request("ctx", [1] * 190, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError):
        engine.add_request("empty", [], params)
    engine.add_request("2", good[2], params)
    results: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(results) == ["0", "1", "2"]
    for i, p in enumerate(good):
        assert results[str(i)].outputs[0].token_ids == alone(model, p, params)
    assert engine.metrics().num_requests_rejected == 3


def test_llm_offline_api(tmp_path):
    from tidal.embedded import write_byte_tokenizer
    from tidal.model.checkpoint import save_model

    n_tok, _ = write_byte_tokenizer(tmp_path)
    net = init_weights(KimiForCausalLM(tiny_k3(vocab_size=(n_tok + 63) // 64 * 64, mxfp4=False)), seed=1)
    save_model(net, tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory_bytes=1 << 22, page_size=PAGE)
    assert llm.tokenizer is not None
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    [out] = llm.generate("hello", greedy)
    comp = out.outputs[0]
    prompt_ids = llm.tokenizer.encode("hello")
    assert out.prompt == "hello" and out.prompt_token_ids == prompt_ids and out.finished
    assert len(comp.token_ids) == 12 and comp.finish_reason == "length"
    assert comp.text == llm.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
    assert len(comp.logprobs) == 12 and all(comp.logprobs[i][t].rank == 1 for i, t in enumerate(comp.token_ids))
    chosen = [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)]
    assert comp.cumulative_logprob == pytest.approx(sum(chosen))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    assert all(prompt_ids[i] in out.prompt_logprobs[i] for i in range(1, len(prompt_ids)))
    # A stop string cut out of the greedy text ends that same generation early.
    stop = next(comp.text[i : i + 2] for i in range(2, len(comp.text) - 1) if "\ufffd" not in comp.text[i : i + 2])
    [cut] = llm.generate("hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop))
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.outputs[0].text == comp.text[: comp.text.find(stop)]
    # stop_token_ids end on the token (kept in token_ids), unless min_tokens is not reached yet.
    tok = comp.token_ids[3]
    first = comp.token_ids.index(tok)
    [st] = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                                 stop_token_ids=[tok]))
    assert st.outputs[0].token_ids == comp.token_ids[: first + 1] and st.outputs[0].stop_reason == tok
    [mt] = llm.generate({"prompt_token_ids": prompt_ids},
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[tok],
                                       min_tokens=first + 1))
    assert tok not in mt.outputs[0].token_ids[: first + 1]
    # n > 1: one output per prompt with n completions, sample i seeded seed + i.
    hot = SamplingParams(n=3, seed=4, temperature=1.5, max_tokens=5, ignore_eos=True)
    [many, single] = llm.generate(["hello", "hello"], [hot, hot.for_sample(2)])
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert many.outputs[2].token_ids == single.outputs[0].token_ids
    with pytest.raises(RequestTooLongError):
        llm.generate(["a", {"prompt_token_ids": [1] * 5000}], greedy)
    assert not llm.engine.has_unfinished_requests()


def test_n_samples_fork_from_the_first_samples_cached_prompt(model):
    """n > 1: sample i is what a lone request with seed + i gives; the siblings start from the
    first sample's cached state one token short of the prompt (prefix-cache hits), and the
    same seed reproduces all three."""
    from tidal.llm import _merge

    prompt = [random.Random(5).randrange(1, 200) for _ in range(23)]
    params = SamplingParams(n=3, seed=9, temperature=1.5, max_tokens=6, ignore_eos=True)

    def run() -> tuple[list[list[int]], int]:
        engine = make_engine(model)
        ids = [f"{i}_r" for i in range(3)]
        for i, sid in enumerate(ids):
            engine.add_request(sid, prompt, params.for_sample(i), fork_of=ids[0] if i else None)
        results: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
        merged = _merge("r", [results[s] for s in ids])
        assert [c.index for c in merged.outputs] == [0, 1, 2]
        assert [results[s].num_cached_tokens for s in ids] == [0, len(prompt) - 1, len(prompt) - 1]
        return [c.token_ids for c in merged.outputs], engine.metrics().prefix_cache_hits

    samples, hits = run()
    assert hits == 2 * (len(prompt) - 1)
    assert len({tuple(s) for s in samples}) == 3
    assert run()[0] == samples
    for i, s in enumerate(samples):
        assert alone(model, prompt, params.for_sample(i)) == s
    greedy = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)
    engine = make_engine(model)
    engine.add_request("0_g", prompt, greedy.for_sample(0))
    engine.add_request("1_g", prompt, greedy.for_sample(1), fork_of="0_g")
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert outs["0_g"].outputs[0].token_ids == outs["1_g"].outputs[0].token_ids == alone(model, prompt, greedy.for_sample(0))


def test_logit_bias_outside_the_vocabulary_is_refused(model):
    engine = make_engine(model)
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"token id {V + 3} is outside the vocabulary of size {V}"):
        engine.add_request("b", [1, 2], SamplingParams(logit_bias={V + 3: 1.0}))
    with pytest.raises(ValueError, match="one sample per request"):
        engine.add_request("n", [1, 2], SamplingParams(n=2))
