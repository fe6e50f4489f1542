"""How well a drafter's confidence predicts the target, per chain position, on the embedded model:
the engine is told to speculate at every step (every request's drafts verified, none paused),
and for each verified chain position j the script averages the drafter's predicted reach (its
confidences multiplied up to j), the calibrated reach the cut compared (that times
:class:`tidal.spec.calibration.ReachCalibration`'s factor when the chain was drafted), and
whether the target reached j (every draft up to j accepted). A drafter that is well calibrated
has predicted == actual; where predicted is above actual, the uncalibrated cut verifies
positions that do not pay. Only positions the cut let through are counted (``n``), so the
deepest rows describe the surest chains; ``--no-calibration`` cuts on the drafter's own word.

    PYTHONPATH=. python benchmarks/bench_spec_calibration.py [--concurrency 1 32] [--workload code]
        [--tokens 64] [--algorithm DSPARK] [--no-calibration]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from tidal import LLM, SamplingParams
from tidal.spec.calibration import ReachCalibration, reach_of

from bench_spec import prompts_for
from bench_spec_steps import Fixed


class Uncalibrated(ReachCalibration):
    """Measures like the calibration but leaves the cut at the drafter's own word."""

    def factor(self, position: int) -> float:
        return 1.0


def measure(conc: int, args) -> None:
    extra = {}
    if args.algorithm == "DSPARK":
        extra["speculative_draft_model_path"] = str(Path(__file__).resolve().parents[1] / "tidal" / "assets"
                                                    / "embedded-dspark")
    llm = LLM(enable_prefix_caching=False, speculative_algorithm=args.algorithm, **extra)
    engine, spec = llm.engine, llm.engine.spec
    spec.policy = Fixed(True)
    spec.backoff.min_rate = 0.0
    if args.no_calibration:
        spec.calibration = Uncalibrated()
    drafted: dict[str, tuple[list[float], list[float]]] = {}  # request id -> (predicted, calibrated) reach
    sums: list[list[float]] = []  # per position: n, predicted, calibrated, reached
    extend, commit = spec.extend, spec.commit

    def extend_and_note(batch, budget):
        extend(batch, budget)
        for i, d in batch.drafts.items():
            reach = reach_of(d)
            drafted[batch.requests[i].request_id] = (reach, [r * spec.calibration.factor(j)
                                                             for j, r in enumerate(reach)])

    def commit_and_count(chains, taps=None):
        for req, _, _, accepted, _ in chains:
            predicted, calibrated = drafted.pop(req.request_id, ([], []))
            for j, (p, c) in enumerate(zip(predicted, calibrated)):
                while len(sums) <= j:
                    sums.append([0.0, 0.0, 0.0, 0.0])
                s = sums[j]
                s[0] += 1
                s[1] += p
                s[2] += c
                s[3] += accepted > j
        return commit(chains, taps)

    spec.extend, spec.commit = extend_and_note, commit_and_count
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for i, p in enumerate(prompts_for(args.workload, llm.tokenizer, conc)):
        enc = llm.tokenizer.encode(p)
        engine.add_request(f"r{i}", list(getattr(enc, "ids", enc)), params)
    while engine.has_unfinished_requests():
        engine.step()
    print(f"conc {conc}: cut at reach {spec.policy.min_confidence(conc):.2f}, "
          f"{'uncalibrated' if args.no_calibration else 'calibrated'}; load average {os.getloadavg()[0]:.1f}")
    print(f"  {'pos':>3} {'n':>5} {'predicted':>9} {'calibrated':>10} {'actual':>6}")
    for j, (n, p, c, r) in enumerate(sums):
        print(f"  {j:>3} {int(n):>5} {p / n:>9.3f} {c / n:>10.3f} {r / n:>6.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--workload", default="code", choices=["repeat", "chat", "code"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--algorithm", default="DSPARK", type=str.upper, help="a drafter that gives confidences")
    ap.add_argument("--no-calibration", action="store_true", help="cut on the drafter's own confidences")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for conc in args.concurrency:
        measure(conc, args)


if __name__ == "__main__":
    main()
