"""Batch-1 decode by thread count and OpenMP wait policy, on a quiet CPU and beside busy processes.

    PYTHONPATH=. python benchmarks/bench_wait_policy.py                    # 2 rounds, quiet and 2 busy
    PYTHONPATH=. python benchmarks/bench_wait_policy.py --configs 2:0 1:0 2:3000 --busy 0 2 --rounds 3

libgomp reads its wait policy once, when torch loads it, so each configuration runs in its own
process (vs_llamacpp.py's 223M model, bf16 trunk): a prefilled 128-token sequence, then --steps
timed decode steps (median ms/step). A configuration is THREADS:SPINS; ``GOMP_SPINCOUNT`` = SPINS
is how many times a waiting thread polls before it sleeps (libgomp's unit is ~10 ns), on top of
tidal's OMP_WAIT_POLICY=PASSIVE (0: sleep at once). Configurations alternate within each round so
drift in the machine's load hits them all; the ratios against the first configuration of the same
round are the figures to read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, os, statistics, sys, time
sys.path.insert(0, {bench!r})
sys.path.insert(0, {tree!r})
import tidal, torch
assert tidal.__file__.startswith({tree!r}), tidal.__file__
from count_decode_ops import decode_engine
from vs_llamacpp import CONFIG, checkpoint
from tidal import LLM
torch.set_num_threads({threads})
llm = LLM(str(checkpoint(CONFIG)), dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 28)
engine = decode_engine(llm, 32000, {batch})
for _ in range(4):
    engine.step()
print("ready", flush=True)
sys.stdin.readline()  # the parent starts the busy processes, then says go
clock = time.{clock}
times = []
for _ in range({steps}):
    t0 = clock()
    engine.step()
    times.append(clock() - t0)
print(json.dumps(statistics.median(times)), flush=True)
"""
BUSY = "while True: pass"
ROOT = Path(__file__).resolve().parent.parent


def run(config: str, busy: int, steps: int, tree: Path = ROOT, batch: int = 1, clock: str = "perf_counter") -> float:
    """Median seconds per decode step of ``batch`` sequences, in a fresh process importing tidal from
    ``tree``, at config THREADS:SPINS, beside ``busy`` busy-looping processes; ``clock``: the ``time``
    function that times a step (``process_time``: the CPU seconds of all the process's threads)."""
    threads, spins = (int(v) for v in config.split(":"))
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT=str(spins))
    code = CHILD.format(bench=str(Path(__file__).resolve().parent), tree=str(Path(tree).resolve()), steps=steps,
                        threads=threads, batch=batch, clock=clock)
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    hogs = []
    try:
        while child.stdout.readline().strip() != "ready":
            if child.poll() is not None:
                raise RuntimeError(f"the decode process exited with {child.returncode}")
        hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
        time.sleep(0.3 if busy else 0)
        child.stdin.write("go\n")
        child.stdin.flush()
        return float(json.loads(child.stdout.readline()))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        child.kill()
        child.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["2:0", "1:0", "2:3000"], help="THREADS:SPINS ...")
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args(argv)
    print(f"## batch-1 decode ms/step by threads:GOMP_SPINCOUNT (OMP_WAIT_POLICY=PASSIVE), "
          f"load {os.getloadavg()[0]:.2f}")
    print("| busy processes | round | " + " | ".join(args.configs) + " | load |")
    print("|---" * (len(args.configs) + 3) + "|")
    ratios: dict[tuple[int, int], list[float]] = {}
    for busy in args.busy:
        for r in range(args.rounds):
            ms = [run(c, busy, args.steps) * 1e3 for c in args.configs]
            for s, m in zip(args.configs, ms):
                ratios.setdefault((busy, s), []).append(ms[0] / m)
            cells = [f"{m:.1f}" + ("" if i == 0 else f" ({ms[0] / m:.2f}x)") for i, m in enumerate(ms)]
            print(f"| {busy} | {r + 1} | " + " | ".join(cells) + f" | {os.getloadavg()[0]:.2f} |")
    for (busy, s), rs in ratios.items():
        if s != args.configs[0]:
            print(f"busy {busy}, {s}: median speed-up over {args.configs[0]} = {statistics.median(rs):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
