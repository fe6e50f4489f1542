"""Speculative decoding on the embedded model: decode tokens/s with and without speculation at
several concurrencies, in the same run, and the accept length.

Workloads (greedy, ``ignore_eos``):
- ``repeat``: prompts that repeat their own context (a Python source file of the standard library
  quoted back: the prompt is the file's first lines, then those lines again up to a point), the
  case prompt lookup (NGRAM) is for;
- ``chat``: short chat-like prompts with no repeated context;
- ``code``: code completion on stdlib modules the embedded model (and its DSPARK drafter) never
  trained on (``tidal.train.data.HELDOUT_MODULES``): a window of a module's lines, continued.

Drafters (``--algorithms``): NGRAM, and DSPARK with the drafter shipped beside the embedded model
(``tidal/assets/embedded-dspark``, ``--dspark-path`` for another).

Decode tok/s counts the tokens emitted by steps without prefill work and divides by those steps'
wall time (prefill is the same with and without speculation). The machine is shared and its speed
swings within a run (by a quarter between runs of a second), so the engines run in lockstep: in a
round every engine (plain, each drafter, a second plain engine ``plain2``) is given the same
prompts, and the loop steps each engine with work once, in turn, the order reversed at every turn,
so all of them decode through the same seconds of the machine; ``--repeats`` rounds on the same
prompts, after one round that is not counted (``first``: its ratio, shown apart): an engine meets
each batch size once, and its cost policy explores there at first (tidal.spec.policy), a cost it
pays once in its life, which a server spreads over hours and a 64-token round over a second. A
cell's ratio is the median over the counted rounds of that round's speculative tok/s over the first
plain engine's; ``plain2 / plain`` is the same ratio between two identical plain engines: the noise
floor of the cell. ``slower`` marks a drafter whose median ratio is below 1 by more than the
floor's largest deviation from 1 in that cell (slower than noise explains).

``--trees A B`` compares source trees (e.g. ``main=git:main new=.``) in one command: this script
runs from each in turn, ``--rounds`` times alternating (:mod:`trees`), and a summary lists each
tree's rows; compare the trees' ratios (each against its own plain engine in the same run), not
their tok/s.

    python benchmarks/bench_spec.py [--concurrency 1 8 32] [--k K] [--dspark-k K] [--tokens 64] [--threads 1]
        [--algorithms NGRAM DSPARK] [--workloads repeat chat code] [--repeats 3]
        [--trees main=git:main new=. --rounds 2]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tidal import LLM, SamplingParams

from trees import run_trees

CHAT = ["Tell me about the ocean.", "What is a good name for a cat?", "Explain recursion briefly.",
        "Write a haiku about autumn.", "How do I boil an egg?", "Why is the sky blue?",
        "List three prime numbers.", "What does a compiler do?"]


def repeat_prompts(tok, n: int, lines: int = 14) -> list[str]:
    """Source files quoted back: the first ``lines`` lines, a blank line, then the same lines cut
    after their third line (the model continues copying)."""
    import collections, textwrap  # noqa: E401 - sources of plain text that ships with Python
    files = [inspect.getsourcefile(m) for m in (collections, textwrap, json, argparse, inspect, os.path)]
    out = []
    for i in range(n):
        with open(files[i % len(files)]) as f:
            text = f.read().splitlines()
        start = 40 + 23 * (i // len(files))
        body = [line for line in text[start : start + lines]]
        out.append("\n".join(body) + "\n\n" + "\n".join(body[:3]) + "\n")
    return out


def code_prompts(n: int, lines: int = 24) -> list[str]:
    """Windows of held-out stdlib modules (never in the embedded model's or drafter's training)."""
    from tidal.train.data import HELDOUT_MODULES, stdlib_dir

    out = []
    for i in range(n):
        name = HELDOUT_MODULES[i % len(HELDOUT_MODULES)]
        text = (stdlib_dir() / f"{name}.py").read_text().splitlines()
        start = 30 + 17 * (i // len(HELDOUT_MODULES))
        out.append("\n".join(text[start : start + lines]) + "\n")
    return out


def prompts_for(work: str, tok, n: int) -> list[str]:
    if work == "repeat":
        return repeat_prompts(tok, n)
    if work == "code":
        return code_prompts(n)
    return [CHAT[i % len(CHAT)] for i in range(n)]


class Run:
    """One engine's share of a round: its requests added, then :meth:`step` until :attr:`done`."""

    def __init__(self, llm: LLM, prompts: list[str], tokens: int) -> None:
        self.engine = engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            enc = llm.tokenizer.encode(p)
            engine.add_request(f"r{time.monotonic_ns()}_{i}", list(getattr(enc, "ids", enc)), params)
        m = engine.spec.metrics if engine.spec else None
        self.spec0 = (m.num_chains, m.avg_accept_length * m.num_chains) if m else None
        self.decode_s, self.decode_tokens = 0.0, 0

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        engine = self.engine
        prefill = any(r.num_uncomputed > 1 for r in engine.scheduler.running) or bool(engine.scheduler.waiting)
        before = engine.metrics().generation_tokens
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if not prefill:
            self.decode_s += dt
            self.decode_tokens += engine.metrics().generation_tokens - before

    def result(self) -> tuple[float, int, float | None]:
        """(decode tok/s, decode tokens, accept length of this run's chains or None)."""
        accept = None
        if self.spec0 is not None:
            m = self.engine.spec.metrics
            chains = m.num_chains - self.spec0[0]
            accept = (m.avg_accept_length * m.num_chains - self.spec0[1]) / chains if chains else None
        return (self.decode_tokens / self.decode_s if self.decode_s else 0.0, self.decode_tokens, accept)


def run(llm: LLM, prompts: list[str], tokens: int) -> tuple[float, int, float | None]:
    """One engine alone: (decode tok/s, decode tokens, accept length of this run's chains or None)."""
    one = Run(llm, prompts, tokens)
    while not one.done:
        one.step()
    return one.result()


def lockstep(engines: dict[str, LLM], prompts: list[str], tokens: int) -> dict[str, tuple]:
    """Every engine on the same prompts, stepped one step each in turn (the order reversed at every
    turn) until all finish: each engine's :func:`run` result, measured through the same seconds."""
    runs = {name: Run(llm, prompts, tokens) for name, llm in engines.items()}
    turn = 0
    while not all(r.done for r in runs.values()):
        order = list(runs.values()) if turn % 2 == 0 else list(runs.values())[::-1]
        for r in order:
            if not r.done:
                r.step()
        turn += 1
    return {name: r.result() for name, r in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--k", type=int, default=None, help="speculative_num_draft_tokens (default: the engine's)")
    ap.add_argument("--dspark-k", type=int, default=None, help="DSPARK's block size (default: --k, else the engine's)")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="lockstep rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workloads", nargs="+", default=["repeat", "chat", "code"])
    ap.add_argument("--replay", action="store_true", help="--enable-linear-replayssm-spec")
    ap.add_argument("--algorithms", nargs="+", default=["NGRAM", "DSPARK"], type=str.upper)
    ap.add_argument("--dspark-path", default=None, help="DSPARK drafter (default: the shipped one)")
    ap.add_argument("--trees", nargs="+", default=None, help="name=PATH or name=git:REV of trees to compare")
    ap.add_argument("--rounds", type=int, default=2, help="with --trees: runs of each tree, alternating")
    args = ap.parse_args()
    if args.trees:
        summary(run_trees("bench_spec.py", sys.argv[1:], args.trees, args.rounds), args.workloads)
        return
    torch.set_num_threads(args.threads)
    dspark = args.dspark_path or str(Path(__file__).resolve().parents[1] / "tidal" / "assets" / "embedded-dspark")
    engines = {"plain": LLM(enable_prefix_caching=False)}
    for algo in args.algorithms:
        k = args.dspark_k or args.k if algo == "DSPARK" else args.k
        extra = {"speculative_draft_model_path": dspark, "speculative_dspark_block_size": k} \
            if algo == "DSPARK" else {"speculative_num_draft_tokens": k}
        engines[algo] = LLM(enable_prefix_caching=False, speculative_algorithm=algo,
                            enable_linear_replayssm_spec=args.replay, **extra)
    engines["plain2"] = LLM(enable_prefix_caching=False)
    cfg = engines[args.algorithms[0]].engine.spec.config
    ks = ", ".join(f"{a} k={engines[a].engine.spec.config.num_draft_tokens}" for a in args.algorithms)
    print(f"embedded model, float32, {args.threads} thread(s), {ks}, rollback {cfg.rollback}, speculation "
          f"{'adaptive (tidal.spec.policy)' if cfg.adaptive else 'always'}, {args.repeats} lockstep rounds, "
          f"{args.tokens} tokens; load average {os.getloadavg()[0]:.1f}")
    print(f"{'workload':9} {'drafter':8} {'conc':>4} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} "
          f"{'rounds':>11} {'accept len':>10} {'plain2/plain':>17} {'':6} {'first':>5} {'load':>5}")
    for work in args.workloads:
        for conc in args.concurrency:
            prompts = prompts_for(work, engines["plain"].tokenizer, conc)
            first = lockstep(engines, prompts, args.tokens)  # not counted (see the module docstring)
            got = round_robin(engines, prompts, args.tokens, args.repeats)
            floor = ratios(got["plain2"], got["plain"])
            for algo in args.algorithms:
                print(cell(work, algo, conc, got[algo], got["plain"], floor, first[algo][0] / first["plain"][0]),
                      flush=True)


def summary(lines: dict[str, list[str]], workloads: list[str]) -> None:
    """Each tree's result rows (one per run), grouped by tree."""
    print("\nsummary (per tree, one row per run):")
    for name, got in lines.items():
        for line in got:
            if line.split(" ", 1)[0] in workloads:
                print(f"{name:8} {line}")


def round_robin(engines: dict[str, LLM], prompts: list[str], tokens: int, rounds: int) -> dict[str, list]:
    """Each engine's :func:`run` results, one per round of :func:`lockstep`. Keyed as ``engines``,
    plain engines ("plain", "plain2") included."""
    got: dict[str, list] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, result in lockstep(engines, prompts, tokens).items():
            got[name].append(result)
    return got


def ratios(runs: list, base: list) -> list[float]:
    """Per round: the tok/s of ``runs`` over that of ``base`` (results of :func:`run`)."""
    return [a[0] / b[0] if b[0] else 0.0 for a, b in zip(runs, base)]


def slower_than_noise(ratio: float, floor: list[float]) -> bool:
    """A median ratio below 1 by more than the plain-vs-plain ratios ever strayed from 1."""
    return ratio < 1.0 - max(abs(1.0 - f) for f in floor)


def cell(work: str, algo: str, conc: int, rounds: list, plain: list, floor: list[float], first: float) -> str:
    """One row: medians over the rounds, the per-round ratio's range, the noise floor's, and the
    ratio of the uncounted ``first`` round."""
    got = ratios(rounds, plain)
    ratio = statistics.median(got)
    accepts = [r[2] for r in rounds if r[2] is not None]
    accept = f"{sum(accepts) / len(accepts):.2f}" if accepts else "-"
    noise = f"{statistics.median(floor):.2f} ({min(floor):.2f}-{max(floor):.2f})"
    return (f"{work:9} {algo:8} {conc:>4} {statistics.median(r[0] for r in plain):>12.1f} "
            f"{statistics.median(r[0] for r in rounds):>11.1f} {ratio:>6.2f} {min(got):>5.2f}-{max(got):<5.2f} "
            f"{accept:>10} {noise:>17} {'slower' if slower_than_noise(ratio, floor) else '':6} "
            f"{first:>5.2f} {os.getloadavg()[0]:>5.1f}")


if __name__ == "__main__":
    main()
