"""What one decode step costs with speculation, by kind of step, on the embedded model: the CPU
time per step and per committed token of

- ``plain``: a plain engine (no speculation);
- ``<ALGO> chains``: a speculating engine told to speculate at every step (chain steps);
- ``<ALGO> backed-off``: the same engine told never to speculate, with everything else of the
  policy running (shadow drafts, the drafter's context taps): what a speculating engine costs
  where the policy has turned chains off, which should be what a plain engine costs;
- ``<ALGO> adaptive`` (``--adaptive``): the engine with its own policy (exploring, probing and
  backing off as it does in service; it keeps what it learnt across ``--repeats``): where chains
  lose, what the policy's chain steps add to the backed-off cost;

split into the engine's parts (draft = ``SpecDecoder.extend``, execute = the worker's forward,
observe = handing taps to the drafter, commit = accepting and rolling back chains). CPU time
(``time.process_time``, one torch thread) is what the step itself burns, so it is comparable
across processes on a shared machine where wall time is not. Only decode-only steps count.

``--trees A B``: run this script from each source tree in turn (alternating, ``--rounds`` each:
:mod:`trees`, a tree a path or ``git:REV``), so that two versions are compared in one command.

    PYTHONPATH=. python benchmarks/bench_spec_steps.py [--concurrency 1 32] [--workload code] [--tokens 48]
        [--algorithms NGRAM DSPARK] [--adaptive] [--rounds 2] [--trees main=/path/a new=/path/b]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from tidal import LLM, SamplingParams
from tidal.spec.policy import CostPolicy

from bench_spec import prompts_for
from trees import run_trees


class Fixed(CostPolicy):
    """The cost policy with its choice fixed (shadow drafts and confidence cuts as usual)."""

    def __init__(self, choice: bool) -> None:
        super().__init__()
        self.choice = choice

    def speculate(self, num_decodes: int, explore: bool = True) -> bool:
        return self.choice


PARTS = {"draft": ("spec", "extend"), "execute": ("worker", "execute"), "observe": ("engine", "_observe_taps"),
         "commit": ("engine", "_commit_chains")}


def timed(llm: LLM, parts: dict[str, float]) -> None:
    """Accumulate the CPU time of the engine's parts into ``parts`` (by name) while it runs."""
    engine = llm.engine
    owners = {"spec": engine.spec, "worker": engine.worker, "engine": engine}
    for name, (owner, attr) in PARTS.items():
        obj = owners[owner]
        if obj is None:
            continue
        f = getattr(obj, attr)

        def wrapper(*a, _f=f, _name=name, **k):
            t = time.process_time()
            try:
                return _f(*a, **k)
            finally:
                parts[_name] += time.process_time() - t

        setattr(obj, attr, wrapper)


def measure(llm: LLM, parts: dict[str, float], prompts: list[str], tokens: int) -> tuple[list, dict[str, float]]:
    """(CPU seconds, tokens) of each decode-only step of one run, and the parts' CPU seconds in them."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        enc = llm.tokenizer.encode(p)
        engine.add_request(f"r{time.monotonic_ns()}_{i}", list(getattr(enc, "ids", enc)), params)
    steps, spent = [], defaultdict(float)
    while engine.has_unfinished_requests():
        prefill = any(r.num_uncomputed > 1 for r in engine.scheduler.running) or bool(engine.scheduler.waiting)
        before, tok = dict(parts), engine.metrics().generation_tokens
        t = time.process_time()
        engine.step()
        dt = time.process_time() - t
        if not prefill:
            steps.append((dt, engine.metrics().generation_tokens - tok))
            for k, v in parts.items():
                spent[k] += v - before.get(k, 0.0)
    return steps, spent


def run_here(args) -> None:
    torch.set_num_threads(1)
    dspark = str(Path(__file__).resolve().parents[1] / "tidal" / "assets" / "embedded-dspark")
    engines: dict[str, LLM] = {"plain": LLM(enable_prefix_caching=False)}
    for algo in args.algorithms:
        extra = {"speculative_draft_model_path": dspark} if algo == "DSPARK" else {}
        modes = (("chains", True), ("backed-off", False)) + ((("adaptive", None),) if args.adaptive else ())
        for mode, choice in modes:
            llm = LLM(enable_prefix_caching=False, speculative_algorithm=algo, **extra)
            if choice is not None:
                llm.engine.spec.policy = Fixed(choice)
            if choice:
                llm.engine.spec.backoff.min_rate = 0.0  # every step with a draft verifies it
            engines[f"{algo} {mode}"] = llm
    parts = {name: defaultdict(float) for name in engines}
    for name, llm in engines.items():
        timed(llm, parts[name])
    print(f"embedded model, float32, 1 thread, {args.workload}, {args.tokens} tokens; CPU ms; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'conc':>4} {'engine':20} {'steps':>5} {'ms/step':>8} {'tok/step':>8} {'ms/token':>8} {'vs plain':>8}  parts ms/step")
    for conc in args.concurrency:
        prompts = prompts_for(args.workload, None, conc)
        got = {name: ([], defaultdict(float)) for name in engines}
        for name, llm in engines.items():
            measure(llm, parts[name], prompts[:1], 4)  # warm-up
        for r in range(args.repeats):  # the engines in their order, reversed every other repeat
            for name, llm in list(engines.items())[:: 1 if r % 2 == 0 else -1]:
                steps, spent = measure(llm, parts[name], prompts, args.tokens)
                got[name][0].extend(steps)
                for k, v in spent.items():
                    got[name][1][k] += v
        base = None
        for name, (steps, spent) in got.items():
            n, cpu, toks = len(steps), sum(s for s, _ in steps), sum(t for _, t in steps)
            per_token = cpu / max(1, toks)
            base = per_token if base is None else base
            split = " ".join(f"{k} {v / n * 1e3:.2f}" for k, v in spent.items() if v)
            print(f"{conc:>4} {name:20} {n:>5} {cpu / n * 1e3:>8.2f} {toks / n:>8.2f} {per_token * 1e3:>8.3f} "
                  f"{per_token / base:>8.3f}  {split}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--workload", default="code", choices=["repeat", "chat", "code"])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each engine per concurrency")
    ap.add_argument("--algorithms", nargs="+", default=["NGRAM", "DSPARK"], type=str.upper)
    ap.add_argument("--adaptive", action="store_true", help="also the engine with its own policy")
    ap.add_argument("--trees", nargs="+", default=None, help="name=PATH or name=git:REV of trees to compare")
    ap.add_argument("--rounds", type=int, default=2, help="with --trees: runs of each tree, alternating")
    args = ap.parse_args()
    if not args.trees:
        run_here(args)
        return
    run_trees("bench_spec_steps.py", sys.argv[1:], args.trees, args.rounds)


if __name__ == "__main__":
    main()
