"""The speculation cost policy (tidal.spec.policy): replayed on step costs recorded from the
embedded model (tests/data/spec_step_costs.json, benchmarks/record_spec_steps.py), it commits
tokens within a few percent of the better of always / never speculating at every concurrency
(so at 32 sequences, where verifying chains is slower, it decodes plainly but for its probes);
and greedy output is unchanged when the policy switches a request between chains and plain
decoding mid-request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tidal import SamplingParams
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.presets import tiny_k3
from tidal.spec.decoder import SHADOW_EVERY, SHADOW_OVERHEAD, shadow_interval
from tidal.spec.policy import CostPolicy, RequestBackoff, bucket_of

from test_engine import drive, one_thread, random_prompts  # noqa: F401 - one_thread: autouse
from test_spec import make_engine, outputs, spec_config

RECORDED = Path(__file__).parent / "data" / "spec_step_costs.json"


def recorded_pairs():
    runs = json.loads(RECORDED.read_text())["runs"]
    pairs = {}
    for r in runs:
        pairs.setdefault((r["algorithm"], r["concurrency"]), {})[r["speculate"]] = r["steps"]
    return pairs


def per_token(steps) -> float:
    return sum(s[2] for s in steps) / sum(s[3] for s in steps)


def test_bucket_of():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_drafts_are_cut_where_their_chance_falls_below_a_positions_price():
    """A draft's verified prefix ends before the first token whose chance of being reached (the
    confidences multiplied) is below the least asked; the least grows with the batch (a verified
    position costs more of a token's worth when the step is full), within floor and cap."""
    from tidal.spec.drafter import confident_prefix
    from tidal.spec.drafter import Draft

    d = Draft([5, 6, 7, 8], confidence=[0.9, 0.5, 0.9, 0.2])
    assert [confident_prefix(d, t) for t in (0.0, 0.4, 0.42, 0.5, 0.95)] == [4, 3, 2, 1, 0]
    assert confident_prefix(Draft([5, 6]), 0.99) == 2  # no confidences (NGRAM): all verified
    p = CostPolicy()
    least = [p.min_confidence(n) for n in (1, 2, 8, 32, 256)]
    assert least == sorted(least) and least[0] < 0.1 and least[2] > 0.2
    assert p.confidence_floor <= least[0] and least[-1] == p.confidence_cap


def test_a_large_loss_is_decided_on_one_step_and_a_tie_decodes_plainly():
    """Above one sequence, one step of each kind (after the first, not kept) decides against
    chains that cost twice a plain token; at one sequence the bucket explores fully; a
    speculative token cheaper by less than the margin does not win."""
    def explore(num_decodes, spec_seconds, plain_seconds, tokens):
        p = CostPolicy()
        choices = []
        for _ in range(12):
            s = p.speculate(num_decodes)
            choices.append(s)
            p.record(num_decodes, s, spec_seconds if s else plain_seconds, tokens if s else num_decodes)
        return p, choices

    p, choices = explore(32, 0.3, 0.07, 48)  # 1.5 tokens a sequence at 4.3x the time: 2.9x a token
    assert choices[:4] == [True, True, False, False] and not any(choices[4:]), choices
    assert p.winner(32) is False
    p, choices = explore(32, 0.168, 0.07, 48)  # 1.6x a token: still decided at once
    assert choices[:4] == [True, True, False, False] and not any(choices[4:]), choices
    p, choices = explore(32, 0.126, 0.07, 48)  # 1.2x: explored, min_samples of each kind kept
    assert sum(choices[:8]) == 4 and p.winner(32) is False, choices
    p, choices = explore(1, 0.09, 0.03, 1)  # alone: explored min_samples times each
    assert sum(choices[:8]) == 4 and p.winner(1) is False
    p, _ = explore(8, 0.0995, 0.05, 16)  # 2 tokens per sequence at 1.99x the time: within the margin
    assert p.winner(8) is False
    p, _ = explore(8, 0.09, 0.05, 16)
    assert p.winner(8) is True


def test_the_recording_has_both_sides():
    """At one concurrency speculation is the faster choice, at another plain decoding is: the
    replay below tests both directions of the decision."""
    pairs = recorded_pairs()
    wins = {per_token(p[True]) < per_token(p[False]) for p in pairs.values()}
    assert wins == {True, False}, {k: (per_token(p[True]), per_token(p[False])) for k, p in pairs.items()}


@pytest.mark.parametrize("key", sorted(recorded_pairs()))
def test_replayed_costs_are_near_the_better_choice(key):
    """The policy decides 300 steps; each step costs the next recorded step of the choice it made
    (in recorded order, cycling), and a plain step drafts a shadow as often as the engine's does
    (every max(SHADOW_EVERY, sequences) plain steps), whose
    acceptance is that of the next recorded speculative step. Its seconds per token are within 10%
    of the better choice's, and where the two are far apart it takes the worse one only to
    explore and probe."""
    pair = recorded_pairs()[key]
    policy = CostPolicy()
    cursor = {True: 0, False: 0}
    seconds = tokens = 0.0
    chose = {True: 0, False: 0}
    steps = 300
    shadow = plain_steps = 0
    for step in range(steps):
        num_decodes = pair[True][0][0]
        choice = policy.speculate(num_decodes)
        rec = pair[choice][cursor[choice] % len(pair[choice])]
        cursor[choice] += 1
        chose[choice] += 1
        policy.record(num_decodes, choice, rec[2], rec[3])
        plain_steps += not choice
        if not choice and plain_steps % max(SHADOW_EVERY, num_decodes) == 0:
            spec_step = pair[True][shadow % len(pair[True])]
            shadow += 1
            policy.record_shadow(num_decodes, spec_step[3] / spec_step[0])
        seconds += rec[2]
        tokens += rec[3]
    spec, plain = per_token(pair[True]), per_token(pair[False])
    better = spec < plain
    assert seconds / tokens <= min(spec, plain) * 1.10, (key, seconds / tokens, spec, plain)
    if max(spec, plain) > 1.5 * min(spec, plain):  # far apart: the worse only for exploring and probes
        assert chose[not better] <= 0.15 * steps, (key, chose)


def feed(policy, num_decodes, costs, steps):
    """``steps`` decisions, each recorded at costs[choice] seconds per token; the choices made."""
    got = []
    for _ in range(steps):
        c = policy.speculate(num_decodes)
        policy.record(num_decodes, c, costs[c] * num_decodes, num_decodes)
        got.append(c)
    return got


def test_explores_alternating_then_probes_the_loser_as_rarely_as_it_loses():
    policy = CostPolicy(min_samples=2, probe_every=4, probe_overhead=0.5, skip_first=False)
    got = feed(policy, 1, {True: 0.004, False: 0.020}, 40)  # chains 5x cheaper per token
    assert got[:4] == [True, False, True, False]
    # Winner known at step 5; the loser (plain) loses by 5x: a probe every (5 - 1) / 0.5 = 8 steps.
    assert [i + 1 for i, c in enumerate(got) if not c][2:] == [13, 21, 29, 37]
    assert policy.speculate(32) is True  # another bucket explores on its own
    policy = CostPolicy(min_samples=2, probe_every=4, probe_overhead=0.5, skip_first=False)
    got = feed(policy, 1, {True: 0.011, False: 0.010}, 40)  # close: probes every probe_every steps
    assert [i + 1 for i, c in enumerate(got) if c][2:] == [9, 13, 17, 21, 25, 29, 33, 37]
    assert policy.speculate(32) is False  # chains lost at 1: not tried first at 32


def test_a_step_with_prefill_work_follows_the_measured_winner_without_exploring():
    """Steps with prefill work are never recorded (their cost is the prefill's): they must not
    explore (a bucket that only ever sees such steps would run chains forever), nor count
    towards a probe; once the bucket has a winner they follow it."""
    policy = CostPolicy(min_samples=2, probe_every=4, probe_overhead=0.5, skip_first=False)
    assert [policy.speculate(8, explore=False) for _ in range(20)] == [False] * 20  # unmeasured: plain
    assert policy.steps.get(8, 0) == 0
    assert feed(policy, 8, {True: 0.004, False: 0.020}, 4) == [True, False, True, False]  # explores now
    assert policy.winner(8) is True
    assert all(policy.speculate(8, explore=False) for _ in range(20))  # chains won: mixed steps draft
    steps = policy.steps[8]
    policy = CostPolicy(min_samples=2, probe_every=4, probe_overhead=0.5, skip_first=False)
    feed(policy, 8, {True: 0.030, False: 0.020}, 4)
    assert not any(policy.speculate(8, explore=False) for _ in range(50))  # chains lost: no probes here
    assert policy.steps[8] == steps == 4


def test_an_unmeasured_engine_drafts_no_chain_beside_a_prefill():
    """In the engine: requests decoding while a new one arrives every step (every step holds a
    prefill, with budget to spare for chains) get no chain while the policy has measured nothing;
    once arrivals stop, decode-only steps explore."""
    model = init_weights(KimiForCausalLM(tiny_k3()), seed=0).eval()
    engine = make_engine(model, spec=spec_config("NGRAM", adaptive=True))
    repeats = [[7 + i, 8, 9] * 3 for i in range(12)]  # NGRAM finds a draft in each at once
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("r0", repeats[0], params)
    engine.step()  # r0's prefill
    for i in range(1, len(repeats)):
        engine.add_request(f"r{i}", repeats[i], params)
        engine.step()  # r{i}'s whole prefill beside the others' decodes
        assert engine.spec.metrics.num_chains == 0, f"a chain beside a prefill, step {i}"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.spec.metrics.num_chains > 0  # decode-only steps explore


def test_a_kinds_first_step_is_not_kept():
    policy = CostPolicy(min_samples=1)
    assert feed(policy, 1, {True: 0.5, False: 0.01}, 1) == [True]  # a first chain step, slow: dropped
    assert policy.speculate(1) is True  # still unmeasured
    policy.record(1, True, 0.003, 1)
    assert len(policy.samples[(1, True)]) == 1
    assert policy.seconds_per_token(1, True) == pytest.approx(0.003 / (1 + policy.step_overhead))


def test_a_kinds_first_step_is_dropped_once_not_per_bucket():
    policy = CostPolicy(min_samples=1)
    policy.record(1, True, 0.5, 1)  # the first chain step and the first plain step: dropped
    policy.record(1, False, 0.01, 1)
    assert not policy.samples.get((1, True)) and not policy.samples.get((1, False))
    policy.record(32, True, 0.3, 32)
    policy.record(32, False, 0.2, 32)
    assert len(policy.samples[(32, True)]) == 1 and len(policy.samples[(32, False)]) == 1


def test_a_probe_costs_its_chains_tokens_at_the_loss():
    """A probing chain step commits tokens_per_sequence tokens at the loss ratio each: it costs that
    many times (loss - 1) plain steps more, and comes that much more rarely; a probing plain step
    costs (loss - 1) / tokens chain steps more."""
    policy = CostPolicy(min_samples=1, probe_every=1, probe_overhead=0.5, chain_probe_overhead=0.5, skip_first=False)
    # chains: 3 tokens a sequence in 6x a plain step's time, 2x a plain token
    assert policy.speculate(8) is True
    policy.record(8, True, 0.3, 24)
    assert policy.speculate(8) is False
    policy.record(8, False, 0.05, 8)
    assert policy.loss(8) == pytest.approx(2.0) and policy.winner(8) is False
    assert policy.probe_interval(8) == int(3 * (policy.loss(8) - 1) / 0.5) >= 5  # 3 x (2 - 1) / 0.5
    policy = CostPolicy(min_samples=1, probe_every=1, probe_overhead=0.25, skip_first=False)
    # chains: 4 tokens a sequence in 2x the time, half a plain token's cost
    assert policy.speculate(8) is True
    policy.record(8, True, 0.1, 32)
    assert policy.speculate(8) is False
    policy.record(8, False, 0.05, 8)
    assert policy.winner(8) is True and policy.loss(8) == pytest.approx(2.0)
    assert policy.probe_interval(8) == 1  # (2 - 1) / 4 / 0.25


def test_a_request_pauses_doubling_after_rejected_chains():
    """After each chain that accepts less than min_rate of its drafts, the request skips drafting
    for 1, 2, 4, ... steps (at most max_pause); a chain that does accept ends the streak."""
    backoff = RequestBackoff(min_rate=0.25, max_pause=4)

    def allowed(steps: int) -> list[bool]:
        return [backoff.allows("a") for _ in range(steps)]

    assert allowed(2) == [True, True]
    backoff.record("a", 7, 1)  # 1 of 7: below the rate
    assert allowed(2) == [False, True]
    backoff.record("a", 7, 0)
    assert allowed(3) == [False, False, True]
    backoff.record("a", 4, 0)
    backoff.record("a", 4, 0)  # fourth in a row: 8 steps, capped at 4
    assert allowed(5) == [False] * 4 + [True]
    backoff.record("a", 7, 2)  # 2 of 7 accepted: the streak ends
    backoff.record("a", 7, 0)
    assert allowed(2) == [False, True]
    assert backoff.allows("b")  # requests are apart
    backoff.record("a", 7, 0)
    backoff.forget("a")
    assert backoff.allows("a")


def recorded(policy: CostPolicy, *steps: tuple[int, bool, float, int, int]) -> CostPolicy:
    """``policy`` told of (sequences, speculated, seconds, tokens, how many such steps) in turn."""
    for num_decodes, speculated, seconds, tokens, times in steps:
        for _ in range(times):
            policy.record(num_decodes, speculated, seconds, tokens)
    return policy


def test_the_tail_of_a_batch_does_not_make_chains_look_cheaper():
    """Steps cost a fixed part plus a part per sequence (here 8 ms + 0.75 ms a sequence), and a
    bucket holds steps of several sizes: plain steps of 8, 5 and 5 sequences (a batch whose
    requests finish) against chain steps of 8 committing 2 tokens a sequence in 32 ms. Per token
    the chains cost 2.0 ms against a plain 1.75 ms at 8 sequences: plain decoding wins (counted per
    sequence alone, the small plain steps' 2.35 ms a token made chains win)."""
    policy = recorded(CostPolicy(skip_first=False), (8, True, 0.032, 16, 3))
    for n in (8, 5, 5):
        policy.record(n, False, 0.008 + 0.00075 * n, n)
    assert policy.winner(8) is False


def test_the_loser_is_judged_on_its_whole_window_not_its_last_probes():
    """Three slow plain probes (18 ms against the 12 ms of five plain steps before) while chains win:
    plain decoding's cost is that of all eight, so a few noisy probes do not keep chains on."""
    policy = recorded(CostPolicy(skip_first=False), (8, True, 0.020, 16, 3), (8, False, 0.012, 8, 5))
    assert policy.winner(8) is True
    recorded(policy, (8, False, 0.018, 8, 3))
    want = (5 * 0.012 + 3 * 0.018) / (8 * (8 + policy.step_overhead))
    assert policy.seconds_per_token(8, False) == pytest.approx(want)


def test_a_close_race_is_probed_every_few_steps():
    """Chains 5% cheaper per token: a plain probe costs little, and the race is re-checked every
    probe_every (4) steps."""
    policy = recorded(CostPolicy(skip_first=False), (8, True, 0.0190, 16, 3), (8, False, 0.0100, 8, 3))
    assert policy.winner(8) is True and policy.probe_interval(8) == policy.probe_every == 4


def test_a_few_good_shadow_drafts_after_many_rejected_chains_turn_chains_back_on():
    """The acceptance that decides is that of the last few samples: a drafter wrong at the start
    of a text (ten chains committing their one token at 2.5x a plain step's time) and right after
    (two shadow drafts of which 7 tokens would have been accepted) speculates again."""
    policy = recorded(CostPolicy(skip_first=False), (1, True, 0.025, 1, 10), (1, False, 0.010, 1, 3))
    assert policy.winner(1) is False
    policy.record_shadow(1, 8)
    policy.record_shadow(1, 8)
    assert policy.winner(1) is True


def test_shadow_drafts_come_ever_rarer_in_a_plain_stretch_down_to_a_few_percent():
    assert shadow_interval(1, 0.0, 0.0) == SHADOW_EVERY  # nothing measured yet
    assert shadow_interval(32, 0.001, 0.030, nth=5) == 32  # one a sequence, as cheap as that
    # a draft costing 60% of a plain step (one sequence): 4, 8, 16 steps apart, then as rarely as
    # keeps it to SHADOW_OVERHEAD
    gaps = [shadow_interval(1, 0.006, 0.010, nth) for nth in range(6)]
    assert gaps[:3] == [SHADOW_EVERY, 2 * SHADOW_EVERY, 4 * SHADOW_EVERY] and gaps[3] == gaps[5], gaps
    n = gaps[-1]
    assert 0.006 / (n * 0.010) <= SHADOW_OVERHEAD < 0.006 / ((n - 2) * 0.010), n


def test_a_probe_that_wins_switches():
    policy = CostPolicy(min_samples=1, window=1, probe_every=2, probe_overhead=1.5, skip_first=False)
    assert feed(policy, 1, {True: 0.05, False: 0.02}, 2) == [True, False]  # chains lose by 2.5x
    assert policy.speculate(1) is False  # step 3
    assert policy.speculate(1) is False  # step 4
    assert policy.speculate(1) is True  # step 5: the probe, (2.5 - 1) / 1.5 = 1 -> probe_every steps on
    policy.record(1, True, 0.01, 1)  # now chains are faster: the winner changes
    assert policy.speculate(1) is True


def test_no_first_try_above_a_bucket_where_speculation_lost():
    policy = CostPolicy(min_samples=1, probe_overhead=0.5, chain_probe_overhead=0.5, probe_every=1, skip_first=False)
    assert feed(policy, 8, {True: 0.03, False: 0.01}, 2) == [True, False]  # chains lose by 3x at 8
    # At 32: plain first (step 1), then chains only as probes, (3 - 1) / 0.5 = 4 steps apart while
    # only the loss at 8 is known (step 6, 4 after the first counted), then (5 - 1) / 0.5 = 8 from
    # there (at 32 they lose by 5x).
    got = feed(policy, 32, {True: 0.05, False: 0.01}, 24)
    assert [i + 1 for i, c in enumerate(got) if c] == [6, 14, 22]
    assert policy.speculate(2) is True  # a smaller bucket still explores


def test_losing_chains_above_one_sequence_are_probed_on_a_quarter_budget():
    """Chains whose token costs 2x a plain one: at one sequence probed every (2 - 1) / 0.01 = 100
    steps, at 32 every (2 - 1) / 0.0025 = 400."""
    policy = CostPolicy(skip_first=False)
    probes = [i + 1 for i, c in enumerate(feed(policy, 32, {True: 0.02, False: 0.01}, 1300)) if c]
    assert probes[0] == 1 and [b - a for a, b in zip(probes[1:], probes[2:])] == [400, 400], probes
    policy = CostPolicy(skip_first=False)
    probes = [i + 1 for i, c in enumerate(feed(policy, 1, {True: 0.02, False: 0.01}, 400)) if c]
    assert len(probes) >= 6 and probes[-1] - probes[-2] == policy.probe_interval(1) == 100, probes


@dataclass
class Alternating(CostPolicy):
    """The cost policy with its choice fixed to every other step (which kind wins depends on the
    machine's timing, so a policy probing the loser would switch as often only where chains lose)."""

    calls: int = 0

    def speculate(self, num_decodes: int, explore: bool = True) -> bool:
        self.calls += 1
        return self.calls % 2 == 1


@pytest.mark.parametrize("algorithm", ["NGRAM", "DSPARK"])
def test_greedy_equal_when_the_policy_switches_mid_request(algorithm, tmp_path):
    """A policy speculating every other step switches every request between chains and plain
    decoding many times; outputs equal plain decoding's, and both kinds of step occurred."""
    model = init_weights(KimiForCausalLM(tiny_k3()), seed=0).eval()
    prompts = [p * 3 for p in random_prompts(5, 6, 6)]  # repeats: NGRAM has matches
    jobs = [(0, str(i), p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for i, p in enumerate(prompts)]
    want = drive(make_engine(model), jobs)
    kw = {}
    if algorithm == "DSPARK":
        from test_dspark import drafter_config
        from tidal.spec.dspark import DsparkModel, save_drafter

        kw = dict(draft_model_path=str(save_drafter(DsparkModel(drafter_config(model)).init_weights(1), tmp_path)),
                  dspark_block_size=3)
    engine = make_engine(model, spec=spec_config(algorithm, adaptive=True, **kw))
    # every draft is verified (a random drafter is never sure of one), and its rejected chains pause
    # no request
    engine.spec.policy = Alternating(skip_first=False, confidence_cap=0.0)
    engine.spec.backoff.min_rate = 0.0
    assert outputs(drive(engine, jobs)) == outputs(want)
    seen = engine.spec.policy.samples
    assert any(len(seen[(b, True)]) >= 3 and len(seen.get((b, False), ())) >= 3 for b, s in seen if s), seen
    assert engine.spec.metrics.num_chains >= 3


@pytest.mark.parametrize("ratio, wins", [(0.95, False), (0.85, True)])
def test_above_one_sequence_adjacent_pairs_decide_with_the_larger_margin(ratio, wins):
    """Plain and chain steps alternate while the machine's load swings 3x: each adjacent pair
    reads the chain's true cost per token, and above one sequence a 5% gain (within
    ``pair_margin``) is not enough to speculate while a 15% one is."""
    policy = CostPolicy(skip_first=False)
    for i in range(8):
        load = 3.0 if i % 2 else 1.0
        policy.record(8, False, 0.010 * load, 8)
        policy.record(8, True, 0.010 * load * ratio * 2, 16)  # 2 tokens a sequence
    assert policy.pair_ratio(8) == pytest.approx(ratio)
    assert policy.winner(8) is wins
    lone = CostPolicy(skip_first=False, min_pairs=100)
    for i in range(8):
        lone.record(8, False, 0.010, 8)
        lone.record(8, True, 0.010 * 0.95 * 2, 16)
    assert lone.pair_ratio(8) is None and lone.winner(8) is True  # too few pairs: the window margin


def test_a_probe_above_one_sequence_comes_as_rarely_as_its_measured_cost_beside_its_neighbours():
    """Chain steps whose mean says 1.2x a plain token (interval (1.2 - 1) x 1 / 0.01 = 20) but each
    of which costs 4 plain steps beyond its neighbour (a cold probe: 5x the time for 1 token a
    sequence, the mean diluted by cheap chain steps not next to a plain one): probes come
    (5 - 1) x 1 / 0.01 = 400 steps apart."""
    policy = CostPolicy(skip_first=False, chain_probe_overhead=0.01)
    for seconds in (0.05, 0.05):  # two adjacent pairs: chain (5x), plain
        policy.record(32, True, seconds, 32)
        policy.record(32, False, 0.01, 32)
    for _ in range(6):
        policy.record(32, True, 0.001, 32)  # cheap chain steps, no plain neighbour after the first
    policy.record(32, False, 0.01, 32)
    assert policy.winner(32) is False and policy.loss(32) < 2.0
    assert sorted(policy.pair_extra[32])[len(policy.pair_extra[32]) // 2] == pytest.approx(4.0)
    assert policy.probe_interval(32) == 400


def test_kept_judgements_equal_fresh_ones():
    """winner and probe_interval are kept until a record changes what they read: over a random
    run of steps and shadow drafts in several buckets, each equals its fresh computation."""
    import random

    rng = random.Random(5)
    policy = CostPolicy()
    for _ in range(3000):
        n = rng.choice([1, 2, 3, 8, 17, 32])
        if rng.random() < 0.1:
            policy.record_shadow(n, rng.uniform(1, 5))
            continue
        chains = policy.speculate(n, explore=rng.random() < 0.95)
        cost = rng.uniform(0.01, 0.03) * (n + 4) * (rng.uniform(1.2, 3.0) if chains else 1.0)
        policy.record(n, chains, cost, n * (rng.randint(1, 4) if chains else 1))
        for b in {bucket_of(m) for m in (1, 2, 3, 8, 17, 32)}:
            assert policy.winner(b) == policy._judge(b), b
            assert policy.probe_interval(b) == policy._interval(b), b
