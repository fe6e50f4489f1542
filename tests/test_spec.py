"""Speculative decoding on a tiny random K3 model (float32): greedy output and logprobs with
speculation equal those without, bit for bit, for both KDA rollback methods; drafts of the
target's own continuation are all accepted, the same shifted by one rejected at once; pool
accounting returns to its start after speculative runs with aborts."""

from __future__ import annotations

import random

import pytest
import torch

from tidal import SamplingParams
from tidal.engine.core import EngineConfig, EngineCore
from tidal.engine.request import RequestOutput
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.plan import pool_layout
from tidal.presets import tiny_k3
from tidal.spec.config import SpeculativeConfig
from tidal.spec.drafter import Draft, NgramDrafter

from test_engine import drive, one_thread, random_prompts  # noqa: F401 - one_thread: autouse

PAGE = 4
K = 4


def spec_config(*args, **kw) -> SpeculativeConfig:
    """Speculation in every step, however many sequences it has (the tests batch many)."""
    return SpeculativeConfig(*args, **{"adaptive": False, **kw})
METHODS = [False, True]  # enable_linear_replayssm_spec: block swap, checkpoint + replay


@pytest.fixture(scope="module")
def model() -> KimiForCausalLM:
    return init_weights(KimiForCausalLM(tiny_k3()), seed=0).eval()


def make_engine(model, *, blocks: int = 64, budget: int = 2048, spec: SpeculativeConfig | None = None,
                drafter=None, **kw) -> EngineCore:
    bb = pool_layout(model.config, 1 << 30, page_size=PAGE, kv_dtype_bytes=4, conv_dtype_bytes=4).block_bytes
    cfg = EngineConfig(max_num_batched_tokens=budget, page_size=PAGE, kv_cache_memory_bytes=blocks * bb,
                       speculative=spec, **kw)
    engine = EngineCore(model, cfg)
    if drafter is not None:
        engine.spec.drafter = drafter
    return engine


class ContinuationDrafter:
    """Drafts from known full sequences (prompt + greedy output): the true next tokens, shifted by
    ``shift`` positions, and (``rng``, ``right``) only a random or given number of them right, the
    rest wrong."""

    def __init__(self, truth: dict[str, list[int]], vocab: int, shift: int = 0, rng: random.Random | None = None,
                 right: int | None = None):
        self.truth, self.vocab, self.shift, self.rng, self.right = truth, vocab, shift, rng, right

    def propose(self, rid: str, token_ids, k: int) -> Draft | None:
        full, n = self.truth[rid], len(token_ids)
        assert list(token_ids) == full[:n]
        tokens = full[n + self.shift : n + self.shift + k]
        if self.rng is not None or self.right is not None:
            right = self.right if self.right is not None else self.rng.randint(0, len(tokens))
            tokens = tokens[:right] + [(t + 1) % self.vocab for t in tokens[right:]]
        return Draft(tokens) if tokens else None

    def forget(self, rid: str) -> None:
        pass


def outputs(results: dict[str, RequestOutput]) -> dict[str, tuple]:
    return {rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for rid, o in results.items()}


def logprobs(results: dict[str, RequestOutput]) -> dict[str, list[float]]:
    return {rid: [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])]
            for rid, o in results.items()}


def assert_logprobs_close(got, want) -> None:
    """float32 matmuls round differently for different row counts, so a chain's logits match a
    decode's to rounding, not bit for bit (tokens do match exactly)."""
    a, b = logprobs(got), logprobs(want)
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid] == pytest.approx(b[rid], abs=1e-4), rid


def jobs_for(prompts, seed: int = 0, logprobs: int | None = 1, stop_from: dict[int, int] | None = None):
    rng = random.Random(seed)
    jobs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=rng.randint(2, 17), ignore_eos=True, logprobs=logprobs,
                                stop_token_ids=[stop_from[i]] if stop_from and i in stop_from else None)
        jobs.append((i // 4, str(i), p, params))
    return jobs


def truth_of(jobs, results) -> dict[str, list[int]]:
    return {rid: list(p) + results[rid].outputs[0].token_ids for _, rid, p, _ in jobs}


def test_greedy_equal_with_random_accept_lengths(model):
    """Many requests in one batch, mixed with prefills, each chain accepting a random number of
    drafts (every rollback position), some finishing inside a chain (max_tokens, a stop token):
    tokens, finish reasons and logprobs equal plain decoding bit for bit."""
    prompts = random_prompts(11, 14, 30)
    base_jobs = jobs_for(prompts)
    base = drive(make_engine(model), base_jobs)
    # A stop token taken from the middle of some outputs ends those requests inside a chain.
    stops = {i: base[str(i)].outputs[0].token_ids[len(base[str(i)].outputs[0].token_ids) // 2]
             for i in range(0, 14, 3) if len(base[str(i)].outputs[0].token_ids) > 3}
    jobs = jobs_for(prompts, stop_from=stops)
    want = drive(make_engine(model), jobs)
    assert any(o.outputs[0].finish_reason == "stop" for o in want.values())
    truth = truth_of(base_jobs, base)
    for budget in (2048, 9):  # whole prompts; chunked prefills that leave chains little room
        for replay in METHODS:
            drafter = ContinuationDrafter(truth, model.config.vocab_size, rng=random.Random(budget))
            spec = spec_config("NGRAM", K, enable_linear_replayssm_spec=replay)
            engine = make_engine(model, budget=budget, spec=spec, drafter=drafter)
            got = drive(engine, jobs)
            assert outputs(got) == outputs(want), (budget, replay)
            assert_logprobs_close(got, want)
            m = engine.spec.metrics
            assert m.num_chains > 3 and 0 < m.num_accepted_tokens < m.num_drafted_tokens


def kda_states(engine: EngineCore, rid: str) -> list[torch.Tensor]:
    """``rid``'s KDA state bytes in the in-process worker, once the copies the books recorded
    since the last step (a replay commit among them) are applied, as the next plan would."""
    block = engine.pool.state_block(rid)
    storage = engine.worker.storage
    storage.apply(engine.pool.take_copies())
    out = []
    for layer in range(engine.model_config.num_kda_layers):
        conv, rec = storage.state_storage(layer)
        out += [conv[block].clone(), rec[block].clone()]
    return out


def test_rollback_methods_agree(model):
    """One verify step accepting r = 0 .. k drafts: the state the block swap keeps (the fused
    decode kernel), the state the replay folds into the checkpoint (the torch decode ops) and the
    state plain decoding reaches token by token agree to float32 rounding, conv windows included
    (not bitwise: the other layers see the chain's rows in one product, a decode's alone), and
    so does the state plain prefill reaches over the same tokens (other kernels)."""
    prompt = random_prompts(15, 1, 25)[0] + [7, 8]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    truth = truth_of([(0, "r", prompt, params)], drive(make_engine(model), [(0, "r", prompt, params)]))
    for right in range(K + 1):
        states = []
        for replay in METHODS:
            drafter = ContinuationDrafter(truth, model.config.vocab_size, right=right)
            e = make_engine(model, spec=spec_config("NGRAM", K, enable_linear_replayssm_spec=replay),
                            drafter=drafter, enable_prefix_caching=False)
            e.add_request("r", prompt, params)
            e.step()  # prefill
            e.step()  # one chain
            assert e.spec.metrics.accept_length_counts[right + 1] == 1
            n = e.requests["r"].num_computed_tokens
            assert n == len(prompt) + 1 + right
            states.append(kda_states(e, "r"))
        decode = make_engine(model, enable_prefix_caching=False)
        decode.add_request("r", prompt, params)
        for _ in range(2 + right):  # the prefill, then 1 + right decode steps
            decode.step()
        assert decode.requests["r"].num_computed_tokens == n
        assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(states[0], kda_states(decode, "r"))), right
        assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(*states)), right
        ref = make_engine(model, enable_prefix_caching=False)
        ref.add_request("r", truth["r"][:n], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        ref.step()
        for x, y in zip(states[0], kda_states(ref, "r")):
            assert torch.allclose(x, y, atol=1e-5, rtol=1e-4), right


@pytest.mark.parametrize("replay", METHODS)
def test_own_continuation_fully_accepted_shifted_rejected(model, replay):
    prompts = random_prompts(12, 6, 20)
    jobs = [(0, str(i), p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for i, p in enumerate(prompts)]
    base = drive(make_engine(model), jobs)
    truth = truth_of(jobs, base)
    spec = spec_config("NGRAM", K, enable_linear_replayssm_spec=replay)
    exact = make_engine(model, spec=spec, drafter=ContinuationDrafter(truth, model.config.vocab_size))
    assert outputs(drive(exact, jobs)) == outputs(base)
    m = exact.spec.metrics
    # 16 tokens: the prefill's, then chains of k+1 = 5 committed tokens each (the last one short).
    assert m.num_accepted_tokens == m.num_drafted_tokens > 0
    assert m.accept_length_counts[K + 1] == 3 * len(prompts)
    assert exact.metrics().num_steps == 4  # prefill + 3 chains cover 1 + 15 tokens
    shifted = make_engine(model, spec=spec, drafter=ContinuationDrafter(truth, model.config.vocab_size, shift=1))
    assert outputs(drive(shifted, jobs)) == outputs(base)
    repeats = sum(1 for t in truth.values() for a, b in zip(t[-16:], t[-15:]) if a == b)
    assert shifted.spec.metrics.position_accepted[0] <= repeats
    assert shifted.spec.metrics.num_chains > 0 and shifted.spec.metrics.avg_accept_length < 1.2


@pytest.mark.parametrize("replay", METHODS)
def test_preemption_and_prefix_hits(model, replay):
    """A pool that holds a few requests (preemption, recompute), and second turns whose prompts
    hit the cache the first turns (generated with speculation) left: same outputs as without."""
    prompts = random_prompts(13, 8, 12)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = [(0, str(i), p, params) for i, p in enumerate(prompts)]
    # The next turn of each conversation: its prompt starts with the whole first turn.
    turns = truth_of(first, drive(make_engine(model), first))
    jobs = first + [(60, f"next{i}", turns[str(i)] + [5, 6], params) for i in range(len(prompts))]
    spec = spec_config("NGRAM", K, enable_linear_replayssm_spec=replay)
    for blocks, run in ((10, first), (64, jobs)):
        want = drive(make_engine(model, blocks=blocks), run)
        engine = make_engine(model, blocks=blocks, spec=spec, drafter=ContinuationDrafter(
            truth_of(run, want), model.config.vocab_size, rng=random.Random(3)))
        assert outputs(drive(engine, run)) == outputs(want), blocks
        m = engine.metrics()
        assert engine.spec.metrics.num_accepted_tokens > 0
        assert (m.num_preemptions > 0) if blocks == 10 else (m.prefix_cache_hits > 0)


@pytest.mark.parametrize("replay", METHODS)
def test_pool_back_to_start_after_spec_runs_with_aborts(model, replay):
    engine = make_engine(model, blocks=8, budget=16, spec=spec_config("NGRAM", K, enable_linear_replayssm_spec=replay))
    start = engine.pool.usage()
    for i, p in enumerate(random_prompts(14, 12, 20)):
        # Prompts that repeat themselves: the n-gram drafter has guesses.
        engine.add_request(str(i), p * 3, SamplingParams(temperature=0, max_tokens=10 + i % 4 * 5, ignore_eos=True))
    aborted = 0
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        assert engine.pool.usage().state_blocks == len(engine.scheduler.running) + (
            engine.prefix_cache.num_snapshots if engine.prefix_cache else 0)  # no chain block outlives its step
        if step in (2, 6, 11) and engine.scheduler.running:
            engine.abort_request(engine.scheduler.running[-1].request_id)
            aborted += 1
    assert not engine.has_unfinished_requests() and aborted == 3
    assert engine.spec.metrics.num_chains > 0
    assert engine.flush_prefix_cache()
    assert engine.pool.usage() == start


def test_ngram_drafter_finds_latest_match_and_repeats_period():
    d = NgramDrafter(max_match=3, min_match=1)
    assert d.propose("r", [5, 6, 7, 8, 1, 5, 6, 7], 3).tokens == [8, 1, 5]
    assert d.propose("r", [5, 6, 7, 8, 1, 5, 6, 7, 9], 2) is None  # 9 never seen before
    assert d.propose("s", [1, 2, 1, 2], 5).tokens == [1, 2, 1, 2, 1]  # runs into its suffix: period 2
    assert d.propose("t", [3], 4) is None


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="one of NGRAM"):
        SpeculativeConfig("EAGLE")
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        SpeculativeConfig("DSPARK")
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        SpeculativeConfig("STANDALONE")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig("NGRAM", 0)
    with pytest.raises(ValueError, match="need speculative_algorithm"):
        SpeculativeConfig.from_args(None, 4)


def test_llm_kwargs_and_stop_strings_inside_a_chain():
    """The embedded model through LLM(speculative_algorithm="NGRAM"): on a prompt that repeats
    itself drafts are accepted, and a stop string that ends inside a chain cuts the text exactly
    where plain decoding does."""
    from tidal import LLM

    prompt = "def add(a, b):\n    return a + b\n\n" * 3 + "def add(a, b):\n"
    plain = LLM(enable_prefix_caching=False)
    spec = LLM(enable_prefix_caching=False, speculative_algorithm="NGRAM", speculative_num_draft_tokens=K)
    assert spec.engine.spec is not None and spec.engine.spec.config.num_draft_tokens == K
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = plain.generate(prompt, base)[0].outputs[0].text
    assert spec.generate(prompt, base)[0].outputs[0].text == text
    assert spec.engine.spec.metrics.num_accepted_tokens > 0
    stop = next((text[i:i + 3] for i in range(6, len(text) - 3) if text.find(text[i:i + 3]) == i), None)
    assert stop is not None
    cut = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    want, got = plain.generate(prompt, cut)[0].outputs[0], spec.generate(prompt, cut)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)
    with pytest.raises(ValueError, match="need speculative_algorithm"):
        LLM(speculative_num_draft_tokens=3)


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampler_reproduces_the_target_distribution(one_hot):
    """Drafts drawn from q, accepted with min(1, p/q), else redrawn from the residual: the first
    committed token is distributed as p (not as q), for a drafter with its own distribution and
    for a deterministic one (told q is one-hot at whatever d it drafted: lossless for any d);
    chi-square at 20000 draws on 8 tokens."""
    from tidal.spec.accept import rejection_sample

    V, N = 8, 20000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(1, V, generator=g) * 1.5, dim=-1)
    counts = torch.zeros(V)
    lengths = [0, 0, 0]
    for _ in range(N):
        d = int(torch.multinomial(q[0], 1, generator=g))
        out = rejection_sample(p, [d], None if one_hot else q, g)
        counts[out[0]] += 1
        lengths[len(out)] += 1
    expected = p[0] * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001
    naive = q[0] * N  # accepting every draft would give q
    assert float(((counts - naive) ** 2 / naive).sum()) > 200
    assert lengths[1] > 0 and lengths[2] > 0  # both rejections and full acceptances happened


def test_sampling_with_speculation_is_seeded_and_runs_chains(model):
    """temperature > 0 goes through the rejection sampler in the engine: chains are verified,
    drafts accepted and rejected, and a seeded request repeats itself exactly."""
    prompts = [p * 3 for p in random_prompts(16, 6, 8)]
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=20, ignore_eos=True) for i in range(6)]
    jobs = [(0, str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    runs = []
    for _ in range(2):
        engine = make_engine(model, spec=spec_config("NGRAM", K))
        runs.append(outputs(drive(engine, jobs)))
        m = engine.spec.metrics
        assert m.num_chains > 0 and m.num_drafted_tokens > m.num_accepted_tokens
    assert runs[0] == runs[1]
    assert all(len(toks) == 20 for toks, _, _ in runs[0].values())


def test_metrics_report_chains_positions_and_accept_length(model):
    """The engine's counters after a speculative run, as /metrics renders them (vLLM's
    spec_decode_* names, per position and accept length) and as /server_info's
    avg_spec_accept_length reads them."""
    from tidal.serve.engine_client import EngineStats
    from tidal.serve.metrics import ServerMetrics

    prompts = random_prompts(17, 4, 12)
    jobs = [(0, str(i), p, SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)) for i, p in enumerate(prompts)]
    truth = truth_of(jobs, drive(make_engine(model), jobs))
    engine = make_engine(model, spec=spec_config("NGRAM", K),
                         drafter=ContinuationDrafter(truth, model.config.vocab_size, rng=random.Random(1)))
    drive(engine, jobs)
    m = engine.metrics()
    assert m.spec_num_chains == engine.spec.metrics.num_chains > 0
    committed = sum(n * c for n, c in enumerate(m.spec_accept_length_counts))
    # the output tokens after the prefill's come from chains, or from plain decodes where the
    # request has one token left (nothing to draft)
    assert 4 * 10 - 4 <= committed <= 4 * 10 and m.avg_spec_accept_length == committed / m.spec_num_chains
    assert m.spec_num_accepted_tokens == sum(m.spec_position_accepted) == committed - m.spec_num_chains
    stats = EngineStats(metrics=m, held_usage=0.0)
    text = ServerMetrics("m", lambda: stats).render()[0].decode()
    assert f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {float(m.spec_num_chains)}' in text
    assert f'tidal:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} ' \
           f'{float(m.spec_position_accepted[0])}' in text
    assert 'tidal:spec_decode_accept_length_total{length="5",model_name="m"}' in text


def test_standalone_drafter_with_the_targets_weights(model):
    """STANDALONE with the target's own weights as the draft model: its greedy drafts are the
    target's continuation (up to float32 rounding of other kernels), so nearly all are accepted,
    and the output equals plain decoding."""
    from tidal.spec.standalone import StandaloneDrafter

    draft = init_weights(KimiForCausalLM(tiny_k3()), seed=0).eval().process_weights_after_loading()
    prompts = random_prompts(18, 5, 16)
    jobs = [(0, str(i), p, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)) for i, p in enumerate(prompts)]
    want = drive(make_engine(model), jobs)
    engine = make_engine(model, spec=spec_config("NGRAM", K),
                         drafter=StandaloneDrafter(draft, model.config.vocab_size))
    assert outputs(drive(engine, jobs)) == outputs(want)
    m = engine.spec.metrics
    assert m.num_chains > 0 and m.acceptance_rate > 0.9
    with pytest.raises(ValueError, match="same tokenizer"):
        StandaloneDrafter(draft, model.config.vocab_size + 1)


def test_requests_whose_drafts_fail_back_off(model):
    """A drafter that is always wrong: each request stops drafting after a chain or two and only
    probes now and then, so most of its steps are plain decodes (output unchanged)."""
    prompts = random_prompts(19, 4, 10)
    jobs = [(0, str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)]
    want = drive(make_engine(model), jobs)
    truth = {rid: [(t + 1) % model.config.vocab_size for t in seq] for rid, seq in truth_of(jobs, want).items()}

    class Wrong(ContinuationDrafter):
        def propose(self, rid, token_ids, k):
            return Draft([(t + 7) % self.vocab for t in token_ids[-k:]])

    engine = make_engine(model, spec=spec_config("NGRAM", K), drafter=Wrong(truth, model.config.vocab_size))
    assert outputs(drive(engine, jobs)) == outputs(want)
    m = engine.spec.metrics
    assert 4 <= m.num_chains <= 4 * 39 // 4  # a quarter of the 39 decode steps per request at most


@pytest.mark.parametrize("replay", METHODS)
def test_verify_plans_replay_into_a_fresh_worker(model, replay):
    """Speculative steps travel in step plans like any other: the chains' slots or replay windows
    ride in the plan, the replay commit as a copy, so a fresh worker fed the recorded plans
    (through the wire format) reproduces every logit row bit for bit."""
    from tidal.cache.allocator import ReplayStates
    from tidal.engine.plan import StepPlan, decode_plan, encode_plan
    from tidal.engine.worker import Worker
    from test_step_plan import record

    prompts = random_prompts(16, 4, 14)
    jobs = [(i, str(i), p, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)) for i, p in enumerate(prompts)]
    truth = truth_of(jobs, drive(make_engine(model), jobs))
    spec = spec_config("NGRAM", K, enable_linear_replayssm_spec=replay)
    engine = make_engine(model, blocks=24, spec=spec, drafter=ContinuationDrafter(
        truth, model.config.vocab_size, rng=random.Random(7)))
    logits = record(engine)
    drive(engine, jobs)
    plans = engine.plan_recorder
    assert sum(len(p.chains) for p in plans) > 3 and 0 < engine.spec.metrics.num_accepted_tokens
    assert any(isinstance(c, ReplayStates) for p in plans for c in p.copies) == replay
    worker = Worker(model, engine.layout, cuda_graph=False)
    for plan, want in zip(plans, logits):
        got = worker.execute(decode_plan(encode_plan(plan)))
        assert (got is None and want is None) or torch.equal(got, want), plan.step
    if replay:  # the replay copies are what carries the commit into the storage
        worker = Worker(model, engine.layout, cuda_graph=False)
        stripped = [StepPlan(**{**vars(p), "copies": [c for c in p.copies if not isinstance(c, ReplayStates)]})
                    for p in plans]
        got = [worker.execute(p) for p in stripped]
        assert not all(a is None or torch.equal(a, b) for a, b in zip(got, logits))
