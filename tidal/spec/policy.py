"""When to speculate: from measured step costs, per batch size.

Speculation pays when a verified chain costs little more than a decode step, which stops being
true once the step is compute-bound (many sequences: every chain position is a full token of
work) or when the drafts are mostly rejected; where that happens depends on the model, the
device, the drafter and the text. vLLM (v0) stops at a fixed size of the running queue
(``speculative_disable_by_batch_size``, vllm PR #4592); an SGLang EAGLE option picks the
speculation settings per batch size with a multi-armed bandit over measured throughput
(``--speculative-eagle-mab-algorithm`` EG / UCB1); DSpark's scheduler sets each request's verify
length from a profiled throughput curve.

Here the engine measures, and splits the cost of a token with chains into what the hardware
decides and what the text decides. Per batch-size bucket (the step's decoding sequences, rounded
up to a power of two) it keeps the wall time of the last ``window`` steps that speculated and
of the last ``window`` that did not, each over its decoding sequences plus ``step_overhead`` (a
step's fixed cost in sequences' worth: a bucket holds steps of different sizes, e.g. the tail of
a batch whose requests finish one by one, and a step of 5 sequences costs much more than 5/8 of
one of 8; steps with prefill work are not counted: their cost is the prefill's): their ratio is
what a chain costs against a decode on
this machine at this batch size, drafting included, and barely depends on the text (the
policy's first step of each kind is not kept: it pays first-use costs). It also keeps the tokens
committed per decoding sequence of the last ``accept_window`` speculative samples of the bucket:
the steps that speculated, and shadow drafts (``record_shadow``: while the
engine decodes plainly it drafts for one request now and then without verifying, and counts how
many drafted tokens the target then produced), so the acceptance of the current text stays
known at the cost of a draft. A step speculates when chain time per sequence / tokens per
sequence is below the plain time per sequence by ``margin`` (near a tie, and in the tail of a
batch whose sequences speculated apart, plain decoding is the safe choice).

How long a chain is verified is decided per drafted token: verifying one more position costs
about the same whether it is accepted or not, and pays a token only if every draft up to it is
accepted. The drafter's own probability of each draft given the ones before, multiplied along
the chain, is roughly the chance the target reaches that position; a position is verified while
that chance is at least the price of a verified position over the worth of a committed token
(``min_confidence``). A decode step costs a fixed part (weights read, kernels launched) plus a
part per token, so a token's worth is the fixed part shared by the step's n sequences plus one
token's work, and a position's price is about one token's work: their ratio is n / (n +
``step_overhead``), with ``step_overhead`` the fixed part in tokens of work (cheap alone, dear
when the step is full). The choice per bucket (above) still decides whether drafting pays at all.

A bucket measures both kinds of step first, alternating, ``min_samples`` each, except that
speculation is not tried first in a bucket above one where it lost (a verified chain only gets
more expensive relative to a decode as the batch grows). After that the losing kind is run
again now and then so its time stays current (each kind is judged on its last ``window``
steps: a loser judged on its last few probes alone read the noise of those few steps, and a
plain step that happened to be slow kept chains on at 8 sequences where they lost by 25%): as
rarely as what one probe costs beyond a step of the winner, over ``probe_overhead``
of such a step (:meth:`CostPolicy.probe_interval`; at least ``probe_every``, at most
``max_probe_every`` steps of the bucket), so that what probing costs stays near
``probe_overhead`` of the bucket's time however far apart the two are. Above one sequence, where
chains lose, probes get a quarter of that (``chain_probe_overhead``): there a probe drafts and
verifies a block for every sequence, and what the policy then loses to plain decoding is
largely its probes; the price is noticing a change of machine or text up to 4x later (the interval is
measured from the last probe and follows the estimates as they change, shadow drafts' acceptance
included). And above one sequence a probe's cost is also taken
from the bucket's adjacent (chain, plain) pairs, where that says more: a chain step's time over
its neighbour plain step's, less its tokens (a probe after a plain stretch pays first-use costs,
the drafter's context of every request and cold memory, that the window's mean understates).

Which requests of a speculating step draft is decided per request (:class:`RequestBackoff`): one
whose last chains were mostly rejected pauses for a number of steps that doubles with each such
chain in a row, so a drafter that is wrong for a stretch of text (confidently, so that the
confidence cut does not help) costs a few short pauses, and one that stays wrong is asked ever
more rarely.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def per_unit(samples) -> float:
    """Sum of the first members of (amount, units) samples over the sum of their units."""
    return sum(a for a, _ in samples) / sum(u for _, u in samples)


def bucket_of(num_decodes: int) -> int:
    """The power of two at or above ``num_decodes`` (1, 2, 4, 8, ...)."""
    return 1 << max(0, num_decodes - 1).bit_length()


@dataclass
class CostPolicy:
    window: int = 8  # recent steps of each kind kept per bucket
    min_samples: int = 3  # of each kind in a bucket before the costs decide
    # recent acceptance samples (speculative steps and shadow drafts): few, so that a stretch of text
    # the drafter gets wrong (or right) changes the choice within a few samples
    accept_window: int = 8
    probe_every: int = 4  # steps of a bucket between runs of the losing kind, at least (a close race: often)
    probe_overhead: float = 0.01  # what probing may cost, as a fraction of the bucket's time
    # the same above one sequence where chains lose (their probes refresh only the chain step's time:
    # the text's part is kept current by shadow drafts; see the module docstring)
    chain_probe_overhead: float = 0.0025
    max_probe_every: int = 1024
    skip_first: bool = True  # the first step of each kind is not kept (first-use costs)
    margin: float = 0.03  # speculation must be this much cheaper per token to be chosen
    # above one sequence: adjacent (plain, chain) step pairs, judged once ``min_pairs`` are kept
    min_pairs: int = 4
    pair_margin: float = 0.08  # speculation must be this much cheaper per token in the median pair
    decisive: float = 1.5  # a loss this large is decided on one step of each kind (see winner)
    step_overhead: float = 16.0  # a decode step's fixed cost, in tokens of work
    confidence_floor: float = 0.02  # drafts below this chance of being reached are never verified
    confidence_cap: float = 0.9  # the surest drafts are always verified (the bucket choice measures them)
    samples: dict[tuple[int, bool], deque] = field(default_factory=dict)  # (seconds, sequences)
    acceptance: dict[int, deque] = field(default_factory=dict)  # per bucket: (tokens committed, sequences)
    steps: dict[int, int] = field(default_factory=dict)
    _probed: dict[int, int] = field(default_factory=dict)  # per bucket: its step count at the last probe
    _last: dict[int, bool] = field(default_factory=dict, repr=False)  # the last winner per bucket
    _warm: set = field(default_factory=set, repr=False)
    pairs: dict[int, deque] = field(default_factory=dict)  # per bucket: chain over plain seconds per token
    pair_extra: dict[int, deque] = field(default_factory=dict)  # per bucket: a pair's chain step beyond its tokens
    _prev: dict[int, tuple[bool, float, float]] = field(default_factory=dict, repr=False)  # last step per bucket
    # What the judgements read changes only in record / record_shadow: each bucket's data carries a
    # version (and all of it one more), and winner / probe_interval are kept until theirs changes
    # (a step asks for them several times).
    _versions: dict[int, int] = field(default_factory=dict, repr=False)
    _version: int = field(default=0, repr=False)
    _winners: dict[int, tuple[int, bool | None]] = field(default_factory=dict, repr=False)
    _intervals: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)

    def speculate(self, num_decodes: int, explore: bool = True) -> bool:
        """Whether a step with ``num_decodes`` decoding sequences should draft. ``explore`` False
        (a step with prefill work: its cost is the prefill's, so it is never recorded): the
        bucket's measured winner, plain while none is known, and no step counted towards a probe;
        exploring there would run chains that teach the policy nothing, step after step, wherever
        requests keep arriving."""
        b = bucket_of(num_decodes)
        if not explore:
            return self.winner(b) is True
        n = self.steps[b] = self.steps.get(b, 0) + 1
        spec, plain = len(self._of(b, True)), len(self._of(b, False))
        lost_below = self._loss_below(b)
        best = self.winner(b)
        if best is None:
            if plain < self.min_samples and (spec >= self.min_samples or lost_below or plain < spec):
                return False
            if spec < self.min_samples and lost_below is None:
                return True
            best = False
        if n - self._probed.setdefault(b, n) >= self.probe_interval(b):
            self._probed[b] = n
            return not best
        return best

    def record(self, num_decodes: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode-only step: ``tokens`` committed in ``seconds`` by ``num_decodes`` sequences,
        with chains or without."""
        if tokens <= 0 or num_decodes <= 0:
            return
        b = bucket_of(num_decodes)
        self._changed(b)
        if speculated:
            self._accept(b, (tokens, num_decodes))
        if self.skip_first and speculated not in self._warm:
            self._warm.add(speculated)
            return
        self._of(b, speculated).append((seconds, num_decodes + self.step_overhead))
        self._pair(b, speculated, seconds / (num_decodes + self.step_overhead) / (tokens / num_decodes),
                   tokens / num_decodes)

    def _pair(self, bucket: int, speculated: bool, per_token: float, tokens: float) -> None:
        """Two adjacent steps of a bucket, one of each kind, make a pair: taken close in time, the
        machine's load changes both alike and cancels in their ratio. ``tokens``: the step's
        committed tokens per sequence."""
        prev = self._prev.get(bucket)
        self._prev[bucket] = (speculated, per_token, tokens)
        if prev is None or prev[0] == speculated:
            return
        (spec, t), plain = ((per_token, tokens), prev[1]) if speculated else ((prev[1], prev[2]), per_token)
        if bucket not in self.pairs:
            self.pairs[bucket] = deque(maxlen=2 * self.window)
            self.pair_extra[bucket] = deque(maxlen=2 * self.window)
        self.pairs[bucket].append(spec / max(plain, 1e-12))
        # the chain step's time beyond what its tokens are worth, in its neighbour plain step's
        self.pair_extra[bucket].append((spec / max(plain, 1e-12) - 1.0) * t)

    def pair_ratio(self, bucket: int) -> float | None:
        """The median over the bucket's recent pairs of a chain step's seconds per token over its
        adjacent plain step's (None: fewer than ``min_pairs`` pairs, or a lone sequence)."""
        got = sorted(self.pairs.get(bucket, ()))
        if bucket == 1 or len(got) < self.min_pairs:
            return None
        mid = len(got) // 2
        return got[mid] if len(got) % 2 else 0.5 * (got[mid - 1] + got[mid])

    def min_confidence(self, num_decodes: int) -> float:
        """The least chance of being reached (the drafter's confidence, multiplied along the
        chain) a drafted token needs to be verified in a step of ``num_decodes`` sequences (see
        the module docstring)."""
        ratio = num_decodes / (num_decodes + self.step_overhead)
        return min(self.confidence_cap, max(self.confidence_floor, ratio))

    def record_shadow(self, num_decodes: int, tokens: float) -> None:
        """A shadow draft in a step of ``num_decodes`` sequences: a chain would have committed
        ``tokens`` (accepted drafts + 1)."""
        self._changed(bucket_of(num_decodes))
        self._accept(bucket_of(num_decodes), (tokens, 1))

    def _changed(self, bucket: int) -> None:
        self._versions[bucket] = self._versions.get(bucket, 0) + 1
        self._version += 1

    def tokens_per_sequence(self, bucket: int) -> float:
        """Committed tokens per decoding sequence of a speculative step in ``bucket``, recently (1
        if unknown)."""
        got = self.acceptance.get(bucket)
        return per_unit(got) if got else 1.0

    def seconds_per_token(self, bucket: int, speculated: bool) -> float | None:
        """What a token costs in ``bucket`` with chains or without, in seconds per sequence plus
        ``step_overhead`` (the same scale for both kinds; None: not measured), over the kind's
        last ``window`` steps."""
        got = self._of(bucket, speculated)
        if not got:
            return None
        return per_unit(got) / (self.tokens_per_sequence(bucket) if speculated else 1.0)

    def winner(self, bucket: int) -> bool | None:
        """True: speculating is the cheaper in ``bucket`` (by ``margin``); None: not measured
        enough. Above one sequence, one step of each kind decides against speculating where its
        token costs ``decisive`` times a plain one (exploring more would cost more than noise
        could explain; a lone sequence explores fully: its chains are the cheapest, its first
        ones often the least accepted)."""
        version = self._versions.get(bucket, 0)
        got = self._winners.get(bucket)
        if got is None or got[0] != version:
            got = self._winners[bucket] = (version, self._judge(bucket))
        return got[1]

    def _judge(self, bucket: int) -> bool | None:
        """:meth:`winner`, computed."""
        spec, plain = self._of(bucket, True), self._of(bucket, False)
        if not spec or not plain:
            return None
        a, c = self.seconds_per_token(bucket, True), self.seconds_per_token(bucket, False)
        if len(spec) < self.min_samples or len(plain) < self.min_samples:
            if bucket == 1 or a < self.decisive * c:
                return None
            self._last[bucket] = False
            return False
        ratio = self.pair_ratio(bucket)
        if ratio is not None:  # above one sequence, adjacent pairs decide (machine noise cancels)
            self._last[bucket] = ratio < 1.0 - self.pair_margin
        else:
            self._last[bucket] = a < c * (1.0 - self.margin)
        return self._last[bucket]

    def chains_lost(self, num_decodes: int) -> bool:
        """Whether chains lost in the bucket of a step of ``num_decodes`` (> 1) sequences, as last
        judged, or, in a bucket not judged yet, in one below it (where they are not tried first; a
        lone sequence's bucket never counts: its chains are the cheapest)."""
        b = bucket_of(num_decodes)
        if b == 1:
            return False
        last = self._last.get(b)
        return last is False or (last is None and self._lost_below(b) is not None)

    def steps_before_probe(self, num_decodes: int) -> int:
        """How many of the next steps of ``num_decodes`` (> 1) sequences will decode plainly, at
        the current estimates, in a bucket where chains lost (0: a bucket that is not decided
        against chains, or a lone sequence's)."""
        b = bucket_of(num_decodes)
        if not self.chains_lost(num_decodes) or b not in self._probed:
            return 0
        return max(0, self.probe_interval(b) - (self.steps.get(b, 0) - self._probed[b]) - 1)

    def defer_probe(self, num_decodes: int) -> None:
        """The probe just chosen for a bucket where chains lost drafted nothing (its requests'
        drafter context is not whole yet): the next steps probe again until one drafts."""
        b = bucket_of(num_decodes)
        if self.chains_lost(num_decodes) and b in self._probed:
            self._probed[b] = -self.max_probe_every

    def loss(self, bucket: int) -> float | None:
        """The loser's seconds per token over the winner's in ``bucket`` (None: not measured)."""
        if self.winner(bucket) is None:
            return None
        a, b = self.seconds_per_token(bucket, True), self.seconds_per_token(bucket, False)
        return max(a, b) / max(min(a, b), 1e-12)

    def probe_interval(self, bucket: int) -> int:
        """Steps of ``bucket`` between runs of the losing kind: what one costs beyond a step of the
        winner, over ``probe_overhead`` of a winner's step. A probing chain step commits
        ``tokens_per_sequence`` tokens a sequence at ``loss`` times a plain token's cost, so it costs
        tokens x (loss - 1) plain steps more; a probing plain step costs (loss - 1) / tokens chain
        steps more. Above one sequence, a probing chain step costs at least what the bucket's
        adjacent pairs measured, and probes of losing chains get ``chain_probe_overhead``
        (see the module docstring)."""
        got = self._intervals.get(bucket)
        if got is None or got[0] != self._version:
            got = self._intervals[bucket] = (self._version, self._interval(bucket))
        return got[1]

    def _interval(self, bucket: int) -> int:
        """:meth:`probe_interval`, computed."""
        loss = self.loss(bucket)
        if loss is None:
            loss, chains_lost = self._loss_below(bucket) or 1.0, True
        else:
            chains_lost = self._last.get(bucket) is False
        tokens = max(1.0, self.tokens_per_sequence(bucket))
        extra = (loss - 1.0) * (tokens if chains_lost else 1.0 / tokens)
        measured = sorted(self.pair_extra.get(bucket, ()))
        if chains_lost and bucket > 1 and measured:
            # what the bucket's chain steps cost beside their neighbours, where that is more: a probe
            # after a plain stretch pays first-use costs (the drafter's context of every request,
            # cold memory) that the window's mean does not show
            extra = max(extra, measured[len(measured) // 2])
        budget = self.probe_overhead if bucket == 1 or not chains_lost else self.chain_probe_overhead
        # (+1e-9: sums of equal samples in another order must not drop a whole step)
        return int(min(self.max_probe_every, max(self.probe_every, extra / budget + 1e-9)))

    def _lost_below(self, bucket: int) -> int | None:
        """The nearest smaller bucket where speculation lost (None: none)."""
        lost = [b for b, s in self.samples if s and b < bucket and self.winner(b) is False]
        return max(lost) if lost else None

    def _loss_below(self, bucket: int) -> float | None:
        """How much speculation lost by in the nearest smaller bucket where it lost (None: none)."""
        below = self._lost_below(bucket)
        return self.loss(below) if below is not None else None

    def _accept(self, bucket: int, sample: tuple[float, int]) -> None:
        if bucket not in self.acceptance:
            self.acceptance[bucket] = deque(maxlen=self.accept_window)
        self.acceptance[bucket].append(sample)

    def _of(self, bucket: int, speculated: bool) -> deque:
        key = (bucket, speculated)
        if key not in self.samples:
            self.samples[key] = deque(maxlen=self.window)
        return self.samples[key]


@dataclass
class RequestBackoff:
    """Per request: after a chain that accepted less than ``min_rate`` of its drafts, the request
    decodes plainly for its next 1, 2, 4, ... steps (doubling with each such chain in a row, at
    most ``max_pause``), then drafts again; a chain at or above the rate ends the streak."""

    min_rate: float = 0.25
    max_pause: int = 32
    _streak: dict[str, int] = field(default_factory=dict)
    _pause: dict[str, int] = field(default_factory=dict)

    def allows(self, request_id: str) -> bool:
        """Whether the request drafts in this step (a step it does not is one of its pause)."""
        left = self._pause.get(request_id, 0)
        if left > 0:
            self._pause[request_id] = left - 1
            return False
        return True

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verified chain of the request: ``accepted`` of its ``drafted`` tokens."""
        if drafted <= 0:
            return
        if accepted >= self.min_rate * drafted:
            self._streak.pop(request_id, None)
            return
        n = self._streak[request_id] = self._streak.get(request_id, 0) + 1
        self._pause[request_id] = min(self.max_pause, 1 << min(n - 1, 30))

    def forget(self, request_id: str) -> None:
        self._streak.pop(request_id, None)
        self._pause.pop(request_id, None)
