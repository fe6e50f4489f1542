"""Decode ms/step of two source trees on the same model, alternated in one command.

    PYTHONPATH=. python benchmarks/bench_decode_ab.py --tree old=/path/to/old/checkout --tree new=. [--batches 1 8]

Answers "did this change make decode faster" where the machine's speed drifts between commands:
each round runs every tree once per batch size, each in a fresh process importing tidal from that
tree (bench_wait_policy.py's child: vs_llamacpp.py's 223M model, bf16 trunk, 2 threads, B prefilled
128-token sequences, then --steps timed decode steps, median). Ratios are against the first tree of
the same round; the load average is printed beside each round. ``--clock cpu`` times a step by the
process's CPU seconds instead (with ``--threads 1``: the step's own cost, which other processes on
a shared machine hardly move; wall time is what a user sees).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wait_policy import run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a tidal checkout (repeat)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args(argv)
    clock = "process_time" if args.clock == "cpu" else "perf_counter"
    trees = dict(t.split("=", 1) for t in args.tree)
    names = list(trees)
    print(f"## decode ms/step ({args.clock} clock) by source tree, {args.threads} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    print("| batch | round | " + " | ".join(names) + " | load |")
    print("|---" * (len(names) + 3) + "|")
    ratios: dict[tuple[int, str], list[float]] = {}
    for b in args.batches:
        for r in range(args.rounds):
            ms = [run(f"{args.threads}:0", 0, args.steps, Path(trees[n]), b, clock) * 1e3 for n in names]
            cells = [f"{m:.1f}" + ("" if i == 0 else f" ({ms[0] / m:.2f}x)") for i, m in enumerate(ms)]
            for n, m in zip(names, ms):
                ratios.setdefault((b, n), []).append(ms[0] / m)
            print(f"| {b} | {r + 1} | " + " | ".join(cells) + f" | {os.getloadavg()[0]:.2f} |")
    for (b, n), rs in ratios.items():
        if n != names[0]:
            print(f"batch {b}: {n} is {statistics.median(rs):.2f}x as fast as {names[0]} (median over rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
