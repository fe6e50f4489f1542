"""How far a drafter's confidence is to be believed, measured on the chains the target verified.

The confidence cut (:meth:`tidal.spec.policy.CostPolicy.min_confidence`) verifies a drafted token
while its chance of being reached, the drafter's confidences multiplied along the chain, is worth a
verified position. A drafter trained on other text is overconfident on new text (the shipped
DSPARK drafter on held-out code: a predicted 0.76 at the fifth draft that the target reached 0.55 of
the time), so the cut verifies positions that do not pay, most of all in large batches where a
position costs nearly a token. Per chain position j, :class:`ReachCalibration` keeps the recent
chains' predicted reach of position j and whether the target reached it (every draft up to j
accepted), exponentially decayed so that the text of the last few dozen chains counts; the cut
then uses the predicted reach times their ratio. A few pseudo-chains at the drafter's own word keep
the first chains from swinging it. Chains measure only the positions the cut let through, so the
plain steps' shadow drafts (:class:`tidal.spec.decoder.SpecDecoder`) are scored on the drafter's
own cut: a factor that fell on one stretch of text can rise again on the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tidal.spec.drafter import Draft


def reach_of(draft: Draft) -> list[float]:
    """The drafter's chance of the target reaching each drafted token (its confidences multiplied
    along the chain; empty without confidences)."""
    out, reach = [], 1.0
    for p in draft.confidence or ():
        reach *= p
        out.append(reach)
    return out


@dataclass
class ReachCalibration:
    decay: float = 0.97  # each chain's weight against the one after it
    prior: float = 2.0  # pseudo-chains at the predicted reach
    predicted: list[float] = field(default_factory=list)  # per position: decayed sums of predicted reach
    reached: list[float] = field(default_factory=list)  # per position: decayed counts of reaching it

    def record(self, reach: Sequence[float], accepted: int) -> None:
        """A verified chain: the predicted reach of each of its drafts, ``accepted`` of them accepted."""
        while len(self.predicted) < len(reach):
            self.predicted.append(0.0)
            self.reached.append(0.0)
        for j, r in enumerate(reach):
            self.predicted[j] = self.decay * self.predicted[j] + r
            self.reached[j] = self.decay * self.reached[j] + (1.0 if accepted > j else 0.0)

    def factor(self, position: int) -> float:
        """How often position ``position`` was reached over how often it was predicted to be (1 where
        no chain measured it)."""
        if position >= len(self.predicted):
            return 1.0
        return (self.reached[position] + self.prior) / (self.predicted[position] + self.prior)

    def prefix(self, draft: Draft, least: float) -> int:
        """How many of ``draft``'s tokens have a calibrated chance of at least ``least`` of being
        reached (all without confidences or a cut): :func:`tidal.spec.drafter.confident_prefix` on
        the measured reach."""
        if draft.confidence is None or least <= 0.0:
            return len(draft.tokens)
        for j, r in enumerate(reach_of(draft)):
            if r * self.factor(j) < least:
                return j
        return len(draft.tokens)
