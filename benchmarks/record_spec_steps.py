"""Record the step costs the speculation policy (tidal.spec.policy) sees, on the embedded model:
for each concurrency and drafter, the decode-only steps of a run that always speculates and of a
run that never does (the same speculative engine: taps and bookkeeping included), as
(decoding sequences, speculated, seconds, tokens committed). tests/test_spec_policy.py replays a
recorded file through the policy.

    PYTHONPATH=. python benchmarks/record_spec_steps.py --out tests/data/spec_step_costs.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from tidal import LLM
from tidal.spec.policy import CostPolicy

from bench_spec import prompts_for, run


class Forced(CostPolicy):
    """Always (or never) speculates, and keeps every step it is told about."""

    def __init__(self, choice: bool) -> None:
        super().__init__()
        self.choice, self.samples = choice, []

    def speculate(self, num_decodes: int, explore: bool = True) -> bool:
        return self.choice

    def record(self, num_decodes: int, speculated: bool, seconds: float, tokens: int) -> None:
        self.samples.append([num_decodes, speculated, round(seconds, 6), tokens])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--algorithms", nargs="+", default=["DSPARK", "NGRAM"], type=str.upper)
    ap.add_argument("--workload", default="code")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dspark = str(Path(__file__).resolve().parents[1] / "tidal" / "assets" / "embedded-dspark")
    out = {"load_average": os.getloadavg()[0], "workload": args.workload, "runs": []}
    for algo in args.algorithms:
        extra = {"speculative_draft_model_path": dspark} if algo == "DSPARK" else {}
        llm = LLM(enable_prefix_caching=False, speculative_algorithm=algo, speculative_num_draft_tokens=4, **extra)
        for conc in args.concurrency:
            prompts = prompts_for(args.workload, llm.tokenizer, conc)
            for choice in (True, False):  # warm-up: the drafter's and the target's first steps
                llm.engine.spec.policy = Forced(choice)
                run(llm, prompts, 4)
            for choice in (True, False):
                llm.engine.spec.policy = forced = Forced(choice)
                run(llm, prompts, args.tokens)
                out["runs"].append({"algorithm": algo, "concurrency": conc, "speculate": choice,
                                    "steps": forced.samples})
                per = sum(s[2] for s in forced.samples) / max(1, sum(s[3] for s in forced.samples))
                print(f"{algo} conc {conc} speculate={choice}: {len(forced.samples)} steps, {per * 1e3:.2f} ms/token, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    Path(args.out).write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
