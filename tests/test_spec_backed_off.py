"""A speculating engine whose policy has turned chains off (tidal.spec.context_gaps, the shadow
drafts of tidal.spec.decoder, tidal.spec.policy): its plain steps do almost nothing speculative.
Where chains lost, the DSPARK drafter makes no shadow drafts and most steps hand it no hidden
states; every draft made afterwards (chains resuming as announced, or at once) reads a whole
context window, and greedy output equals plain decoding throughout."""

from __future__ import annotations

import pytest

from tidal import SamplingParams
from tidal.spec.policy import CostPolicy

from test_dspark import PROMPTS, dspark, model, trained  # noqa: F401 - fixtures
from test_engine import drive, one_thread  # noqa: F401 - one_thread: autouse
from test_spec import make_engine, outputs


class Phases(CostPolicy):
    """The policy's bookkeeping with its choice scripted: phases of (steps, chains, announced).
    A plain phase has chains lost; ``announced``: the probe that ends it is announced
    (steps_before_probe counts down to it), else the chains that follow come unannounced (as
    when a batch moves into a bucket where chains win)."""

    def __init__(self, phases: list[tuple[int, bool, bool]]) -> None:
        super().__init__()
        self.script = [(chains, announced, left) for steps, chains, announced in phases
                       for left in range(steps - 1, -1, -1)]
        self.step = 0  # decode-only steps decided so far
        self.now = self.script[0]  # the last decision's entry

    @property
    def chose(self) -> bool:
        return self.now[0]

    def speculate(self, num_decodes: int, explore: bool = True) -> bool:
        if not explore:
            return False
        self.now = self.script[min(self.step, len(self.script) - 1)]
        self.step += 1
        return self.chose

    def chains_lost(self, num_decodes: int) -> bool:
        return not self.chose

    def min_confidence(self, num_decodes: int) -> float:
        return 0.0  # every draft verified (the test's drafter is unsure of each token)

    def steps_before_probe(self, num_decodes: int) -> int:
        chains, announced, left = self.now
        return 0 if chains else (left if announced else 10**6)


def test_drafts_after_untapped_steps_read_whole_windows_and_output_stays_greedy(model, trained):
    """Plain stretches with chains lost skip the taps; chains resuming unannounced wait until each
    request's window is tapped again, announced ones draft at once; at every draft the drafter's
    cache holds each position of the request's window, and the output equals plain decoding."""
    prompts = PROMPTS[:8]
    jobs = [(0, str(i), p, SamplingParams(temperature=0, max_tokens=230, ignore_eos=True)) for i, p in enumerate(prompts)]
    want = drive(make_engine(model), jobs)
    engine = make_engine(model, spec=dspark(trained), enable_prefix_caching=False)
    phases = [(100, False, False), (40, True, False), (60, False, True), (200, True, False)]
    policy = engine.spec.policy = Phases(phases)
    engine.spec.backoff.min_rate = 0.0  # no request pauses after rejected chains: each drafts when it may
    engine.spec._next_shadow = 10**9  # no shadow drafts: their schedule follows measured times
    drafter, window = engine.spec.drafter, engine.spec.tap_window
    engine.plan_recorder = []
    drafted_at: list[int] = []  # the policy's step of every chain draft

    def checked(asks, least=0.0, _propose=drafter.propose_many):
        for rid, ids, _ in asks:
            held = set(drafter.cache.pos[drafter.cache.slot(rid)].tolist())
            n = len(ids)
            missing = set(range(max(0, n - 1 - window), n - 1)) - held
            assert not missing, (rid, n, sorted(missing))
        if policy.chose:  # a chain step's drafts (not a shadow's)
            drafted_at.append(policy.step)
        return _propose(asks, least)

    drafter.propose_many = checked
    assert outputs(drive(engine, jobs)) == outputs(want)
    untapped = sum(1 for p in engine.plan_recorder if not p.tap_layers)
    assert untapped == 100 + (60 - 2 * window - 1), untapped  # phase 1, and phase 3 until 2 windows before
    resumed, announced = 100, 200  # the last steps of phases 1 and 3 (1-based policy steps)
    # untapped at step 100: a request has its next window whole at step 100 + window + 1
    assert min(s for s in drafted_at if s > resumed) == resumed + window + 1, drafted_at
    assert announced + 1 in drafted_at  # announced: tapped ahead, drafts at once
    assert engine.spec.metrics.num_accepted_tokens > 0


def test_steps_before_probe_counts_down_to_the_probe():
    """At steady costs, a bucket where chains lost says how many plain steps come before its next
    probe, and the probe comes exactly then; a probe that could not draft (defer_probe) is tried
    again at the next step, and once one ran the count starts over."""
    policy = CostPolicy()
    for _ in range(12):
        chains = policy.speculate(32)
        policy.record(32, chains, 0.3 if chains else 0.07, 48 if chains else 32)
    assert policy.chains_lost(32) and not policy.chains_lost(1)
    left = policy.steps_before_probe(32)
    assert left > 100
    for i in range(left):
        assert policy.speculate(32) is False, i
        policy.record(32, False, 0.07, 32)
        assert policy.steps_before_probe(32) == left - i - 1
    assert policy.speculate(32) is True
    policy.defer_probe(32)  # the probe found no request with its context whole: probe again next step
    assert policy.steps_before_probe(32) == 0 and policy.speculate(32) is True
    policy.record(32, True, 0.3, 48)
    assert policy.steps_before_probe(32) > 100 and policy.speculate(32) is False


def test_a_bucket_above_a_lost_one_counts_as_lost_before_it_measured_chains():
    """Chains are not tried first above a bucket where they lost; such a bucket counts as lost
    (no shadow drafts, no taps far from a probe) from its first steps, not only once a probe there
    measured chains (a batch that grew from 8 to 32 sequences tapped every step)."""
    policy = CostPolicy()
    for _ in range(12):
        chains = policy.speculate(8)
        policy.record(8, chains, 0.3 if chains else 0.07, 12 if chains else 8)
    assert policy.chains_lost(8) and policy.chains_lost(32) and not policy.chains_lost(4)  # nothing measured at 32
    for _ in range(policy.min_samples + 1):
        assert policy.speculate(32) is False
        policy.record(32, False, 0.2, 32)
    assert policy.winner(32) is None and policy.chains_lost(32) and not policy.chains_lost(1)
    assert policy.steps_before_probe(32) > 100


def test_the_embedded_engine_at_32_sequences_backs_off_to_nearly_plain_steps():
    """The embedded model with its DSPARK drafter and the engine's own policy, 32 sequences for
    384 tokens: chains lose at 32, decided after a few drafting steps (a step whose drafts were
    all cut counts as one: counted as plain, it left the policy drafting at every step), and then
    no shadow drafts are made at 32 (one every 32 steps before: 12 in such a run) and the plain
    steps tap nothing until two windows before the next probe; the requests' output equals their
    plain decoding (compared for 4 of them: greedy output does not depend on the batch)."""
    from tidal import LLM
    from tidal.embedded import embedded_model_dir

    from test_spec_grammar import DRAFTER

    kw = dict(enable_prefix_caching=False, kv_cache_memory_bytes=64_000_000)
    llm = LLM(embedded_model_dir(), speculative_algorithm="DSPARK", speculative_draft_model_path=str(DRAFTER), **kw)
    engine, tok = llm.engine, llm.engine.tokenizer
    prompts = [tok.encode(f"def step_{i}(state, rate={i / 10}):\n    total = state.count * {i}\n") for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=384, ignore_eos=True)
    jobs = [(0, str(i), p, params) for i, p in enumerate(prompts)]
    drafter = engine.spec.drafter
    engine.plan_recorder = []
    calls = []  # (requests asked, plans recorded before the step)
    drafter.propose_many = lambda asks, least=0.0, _f=drafter.propose_many: \
        calls.append((len(asks), len(engine.plan_recorder))) or _f(asks, least)
    got = outputs(drive(engine, jobs))
    at32 = [p for p in engine.plan_recorder if len(p.query_lens) == 32 and all(q == 1 for q in p.query_lens)]
    policy = engine.spec.policy
    assert policy.chains_lost(32)
    # drafting steps: exploring (the first is not kept; with every draft cut a step still counts)
    assert sum(1 for c, _ in calls if c > 1) <= 4, calls
    lost_at = min(i for i, p in enumerate(engine.plan_recorder) if len(p.query_lens) == 32 and not p.tap_layers)
    assert not [c for c, at in calls if c == 1 and lost_at <= at < len(engine.plan_recorder) - 40], calls  # no shadows
    untapped = sum(1 for p in at32 if not p.tap_layers)
    # tapped after the decision: only the two windows before each probe (and before the next one)
    probes = [at for c, at in calls if c > 1 and at > lost_at]
    assert len(at32) >= 350 and untapped >= len(at32) - lost_at - (2 * engine.spec.tap_window + 2) * (len(probes) + 1)
    plain = LLM(embedded_model_dir(), **kw).engine
    assert outputs(drive(plain, jobs[:4])) == {k: got[k] for k in ("0", "1", "2", "3")}
