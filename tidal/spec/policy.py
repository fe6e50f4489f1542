"""When to speculate: from measured step costs, per batch size.

Speculation pays when a verified chain costs little more than a decode step, which stops being
true once the step is compute-bound (many sequences: every chain position is a full token of
work) or when the drafts are mostly rejected; where that happens depends on the model, the
device, the drafter and the text. vLLM (v0) stops at a fixed size of the running queue
(``speculative_disable_by_batch_size``, vllm PR #4592); an SGLang EAGLE option picks the
speculation settings per batch size with a multi-armed bandit over measured throughput
(``--speculative-eagle-mab-algorithm`` EG / UCB1); DSpark's scheduler sets each request's verify
length from a profiled throughput curve.

Here the engine measures. For each batch-size bucket (the step's decoding sequences, rounded up
to a power of two) it keeps the wall time and the committed tokens of the last ``window`` steps that speculated
and of the last ``window`` that did not (steps with prefill work are not counted: their cost is
the prefill's), and a step speculates when its bucket's speculative seconds per token (total
time over total tokens of those steps) is the lower. The losing choice is judged on its last
``min_samples`` steps only (its probes: older ones describe another text or load), so a probe
that now wins switches soon.
A bucket measures both choices first, alternating, ``min_samples`` steps each, except that
speculation is not tried first in a bucket above one where it lost (a verified chain only gets
more expensive relative to a decode as the batch grows). After that the losing choice is probed
once every ``probe_every`` steps of the bucket, or less often where it loses by more: a probe
costs the loser's excess for one step, so the interval is (loss ratio - 1) / ``probe_overhead``
steps (at most ``max_probe_every``), which keeps what probing costs near ``probe_overhead`` of
the bucket's time however far apart the choices are, and probes often where they are close
(where the text or the load can change the winner).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def per_token(steps) -> float:
    """Seconds per committed token of (seconds, tokens) steps: their total time over their tokens."""
    return sum(s for s, _ in steps) / sum(t for _, t in steps)


def bucket_of(num_decodes: int) -> int:
    """The power of two at or above ``num_decodes`` (1, 2, 4, 8, ...)."""
    return 1 << max(0, num_decodes - 1).bit_length()


@dataclass
class CostPolicy:
    window: int = 8  # recent steps of each choice kept per bucket
    min_samples: int = 3  # of each choice in a bucket before the costs decide
    probe_every: int = 16  # steps of a bucket between probes of the losing choice, at least
    probe_overhead: float = 0.02  # what probing may cost, as a fraction of the bucket's time
    max_probe_every: int = 256
    samples: dict[tuple[int, bool], deque] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    _next_probe: dict[int, int] = field(default_factory=dict)
    _last: dict[int, bool] = field(default_factory=dict, repr=False)  # the last winner per bucket
    _costs: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)

    def speculate(self, num_decodes: int) -> bool:
        """Whether a step with ``num_decodes`` decoding sequences should draft."""
        b = bucket_of(num_decodes)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        spec, plain = len(self._of(b, True)), len(self._of(b, False))
        lost_below = self._loss_below(b)
        if plain < self.min_samples and (spec >= self.min_samples or lost_below or plain < spec):
            return False
        if spec < self.min_samples and lost_below is None:
            return True
        best = self.winner(b) if spec >= self.min_samples else False
        if n >= self._next_probe.setdefault(b, n + self.probe_interval(b)):
            self._next_probe[b] = n + self.probe_interval(b)
            return not best
        return best

    def record(self, num_decodes: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode-only step: ``tokens`` committed in ``seconds``, with chains or without."""
        if tokens > 0 and num_decodes > 0:
            self._of(bucket_of(num_decodes), speculated).append((seconds, tokens))

    def seconds_per_token(self, bucket: int, speculated: bool) -> float | None:
        """Over the bucket's recent steps of that choice (None: none yet)."""
        got = self._of(bucket, speculated)
        return per_token(got) if got else None

    def winner(self, bucket: int) -> bool | None:
        """True: speculating is the cheaper choice in ``bucket``; None: not measured enough. The
        current winner is judged on its last ``window`` steps, the loser on its last
        ``min_samples`` (its probes: older ones describe another text or load)."""
        spec, plain = self._of(bucket, True), self._of(bucket, False)
        if len(spec) < self.min_samples or len(plain) < self.min_samples:
            return None
        last = self._last.get(bucket, True)
        a = per_token(spec) if last else per_token(list(spec)[-self.min_samples:])
        b = per_token(list(plain)[-self.min_samples:]) if last else per_token(plain)
        self._last[bucket] = a < b
        self._costs[bucket] = (a, b)
        return a < b

    def loss(self, bucket: int) -> float | None:
        """The loser's seconds per token over the winner's in ``bucket`` (None: not measured)."""
        if self.winner(bucket) is None:
            return None
        a, b = self._costs[bucket]
        return max(a, b) / max(min(a, b), 1e-12)

    def probe_interval(self, bucket: int) -> int:
        loss = self.loss(bucket) or self._loss_below(bucket) or 1.0
        return int(min(self.max_probe_every, max(self.probe_every, (loss - 1.0) / self.probe_overhead)))

    def _loss_below(self, bucket: int) -> float | None:
        """How much speculation lost by in the nearest smaller bucket where it lost (None: none)."""
        lost = [b for b, s in self.samples if s and b < bucket and self.winner(b) is False]
        return self.loss(max(lost)) if lost else None

    def _of(self, bucket: int, speculated: bool) -> deque:
        key = (bucket, speculated)
        if key not in self.samples:
            self.samples[key] = deque(maxlen=self.window)
        return self.samples[key]
