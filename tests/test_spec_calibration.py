"""The confidence cut on measured reach (tidal.spec.calibration)."""

import pytest

from tidal import SamplingParams
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.presets import tiny_k3
from tidal.spec.calibration import ReachCalibration, reach_of
from tidal.spec.drafter import Draft, confident_prefix

from test_engine import drive, one_thread, random_prompts  # noqa: F401 - one_thread: autouse
from test_spec import K, ContinuationDrafter, make_engine, outputs, spec_config, truth_of
from test_spec_policy import Alternating


def test_unmeasured_is_the_drafters_word():
    """Before any chain, and for positions no chain reached, the cut is confident_prefix's."""
    cal = ReachCalibration()
    d = Draft([1, 2, 3, 4], confidence=[0.9, 0.9, 0.8, 0.5])
    assert reach_of(d) == pytest.approx([0.9, 0.81, 0.648, 0.324])
    for least in (0.0, 0.3, 0.5, 0.7, 0.85, 0.95):
        assert cal.prefix(d, least) == confident_prefix(d, least), least
    assert cal.prefix(Draft([5, 6]), 0.99) == 2  # no confidences (NGRAM): all verified
    cal.record([0.9], 1)
    assert cal.factor(3) == 1.0


def test_an_overconfident_drafter_is_cut_shorter_and_an_honest_one_is_not():
    """Chains predicted 0.9, 0.81, 0.73 whose second draft the target takes half the time: the
    factor at position 1 goes to ~0.55 and a cut of 0.6 stops there; chains reached as predicted
    leave the cut where it was; the decay lets later text change it back."""
    over, honest = ReachCalibration(), ReachCalibration()
    reach = [0.9, 0.81, 0.729]
    for i in range(200):
        over.record(reach, 1 + (i % 2))  # position 1 reached every other chain, position 2 never
        honest.record(reach, [3, 3, 3, 2, 3, 3, 1, 3, 3, 0][i % 10])  # 0.9, 0.8, 0.7 reached
    assert over.factor(0) == pytest.approx(1 / 0.9, rel=0.02)
    assert over.factor(1) == pytest.approx(0.5 / 0.81, rel=0.1)  # (the prior pulls it a little towards 1)
    d = Draft([7, 8, 9], confidence=[0.9, 0.9, 0.9])
    assert confident_prefix(d, 0.6) == 3
    assert over.prefix(d, 0.6) == 1
    assert honest.prefix(d, 0.6) == 3 and honest.factor(1) == pytest.approx(1.0, abs=0.1)
    for _ in range(200):
        over.record(reach, 3)
    assert over.prefix(d, 0.6) == 3


class Sure:
    """A drafter that gives every draft of ``inner`` the same confidence ``p``."""

    def __init__(self, inner, p: float) -> None:
        self.inner, self.p = inner, p

    def propose(self, rid: str, token_ids, k: int) -> Draft | None:
        d = self.inner.propose(rid, token_ids, k)
        return Draft(d.tokens, None, [self.p] * len(d.tokens)) if d is not None else None

    def forget(self, rid: str) -> None:
        self.inner.forget(rid)


class Switching(ContinuationDrafter):
    """Right only in its first draft until a request's sequence is ``until`` tokens long, then right
    in all."""

    def __init__(self, truth, vocab: int, until: int) -> None:
        super().__init__(truth, vocab, right=1)
        self.until = until

    def propose(self, rid: str, token_ids, k: int) -> Draft | None:
        self.right = 1 if len(token_ids) < self.until else None
        return super().propose(rid, token_ids, k)


def sure_engine(drafter_of, max_tokens: int = 40):
    """(An engine whose drafter, ``drafter_of(truth, vocab)``, is 0.95 sure of each draft, cut at
    0.5 and alternating chains and plain steps, what it produced, what plain decoding did)."""
    model = init_weights(KimiForCausalLM(tiny_k3()), seed=0).eval()
    prompts = random_prompts(23, 5, 8)
    jobs = [(0, str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    want = drive(make_engine(model), jobs)
    drafter = Sure(drafter_of(truth_of(jobs, want), model.config.vocab_size), 0.95)
    engine = make_engine(model, spec=spec_config("NGRAM", K), drafter=drafter)
    engine.spec.policy = Alternating(skip_first=False, confidence_floor=0.5, confidence_cap=0.5)
    engine.spec.backoff.min_rate = 0.0
    return engine, drive(engine, jobs), want


@pytest.mark.parametrize("right", [1, None])
def test_an_engine_verifies_fewer_positions_where_the_target_reaches_fewer(right):
    """A drafter 0.95 sure of each of its 4 drafts, cut at 0.5 (all 4 predicted to be reached at
    least 0.81): where only its first draft is ever right, the calibrated cut verifies one after the
    first step's chains; where all are right, every chain verifies all 4 (but near a request's end);
    greedy output equals plain decoding either way."""
    engine, got, want = sure_engine(lambda truth, vocab: ContinuationDrafter(truth, vocab, right=right))
    assert outputs(got) == outputs(want)
    m = engine.spec.metrics
    assert K == 4 and m.num_chains > 30, m.num_chains
    if right == 1:
        # only the first step's chains (one a request, before any chain was measured) verified all 4
        assert m.position_accepted[1] == 0 and m.position_drafted[1] <= 5, m  # (5 requests)
        assert engine.spec.calibration.factor(1) < 0.5
    else:
        assert m.position_drafted[3] >= 0.8 * m.position_drafted[0] and m.num_accepted_tokens == m.num_drafted_tokens


def test_positions_the_cut_stopped_verifying_are_measured_by_shadow_drafts():
    """The drafter is right only in its first draft until a request has 20 tokens (12-19 of its
    120 output tokens), then in all: chains are cut to one draft, and only the plain steps' shadow
    drafts (scored on the drafter's own cut) still measure positions 2-4; they lift the factors
    again, and later chains verify (and accept) all 4. Greedy output equals plain decoding."""
    engine, got, want = sure_engine(lambda truth, vocab: Switching(truth, vocab, until=20), 120)
    assert outputs(got) == outputs(want)
    m = engine.spec.metrics
    assert m.position_accepted[3] >= 20 and engine.spec.calibration.factor(3) > 0.8, (m, engine.spec.calibration)
