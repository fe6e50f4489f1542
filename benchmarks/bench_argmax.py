"""The greedy sampler's argmax of logits rows: csrc/argmax_rows.c against torch's argmax, one command.

    PYTHONPATH=. python benchmarks/bench_argmax.py                  # V = 32000 (the 223M model), B = 1, 8, 32
    PYTHONPATH=. python benchmarks/bench_argmax.py --threads 1 --vocab 163840

Best of --repeats of each, alternating, on the same float32 rows; the ratio is torch / C. The load
average is printed beside the figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import tidal  # noqa: F401  (first: its OpenMP wait policy must be set before torch loads libgomp)
import torch

from tidal.ops.argmax import argmax_rows
from tidal.ops.cpu_kernels import argmax_rows_kernel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if argmax_rows_kernel() is None:
        print("the C kernel is unavailable (TIDAL_CPU_KERNELS=0 or no compiler)")
        return 1
    print(f"## argmax of B x {args.vocab} float32 rows, {args.threads} threads, load {os.getloadavg()[0]:.2f}")
    print("| B | torch us | C us | torch / C |")
    print("|---|---|---|---|")
    for b in args.rows:
        x = torch.randn(b, args.vocab)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        best = {"torch": float("inf"), "C": float("inf")}
        for _ in range(args.repeats):
            for name, fn in (("torch", lambda: x.argmax(dim=-1)), ("C", lambda: argmax_rows(x))):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"| {b} | {best['torch'] * 1e6:.1f} | {best['C'] * 1e6:.1f} | {best['torch'] / best['C']:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
