"""How fast the bf16 trunk's weights stream through the CPU GEMV / small-M GEMM, against the read bandwidth.

    PYTHONPATH=. python benchmarks/bench_gemv.py                 # the 223M model's shapes, M = 1, 4, 8
    PYTHONPATH=. python benchmarks/bench_gemv.py --rows 1 --threads 1

For each weight shape of the trunk (N x K, bf16), the C kernel behind ``tidal.ops.dense.linear``
(csrc/bf16_gemm.c) multiplies M rows by enough copies of the weight that they come from memory (over
twice the L3), best of --repeats; the figure is weight bytes / time. Baselines in the same run: a
read-only stream (torch's int64 sum of 256 MiB on the same threads) and torch's own bf16 F.linear on
the same copies. The load average is printed beside the figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import tidal  # noqa: F401  (first: its OpenMP wait policy must be set before torch loads libgomp)
import torch
import torch.nn.functional as F

from tidal.ops.cpu_kernels import bf16_rows_kernel

# (N, K) of the 223M model's bf16 projections (benchmarks/configs/k3-223m.json, fused as served)
SHAPES = [(32000, 768), (4608, 768), (2048, 768), (768, 2048), (1024, 768), (768, 768), (1152, 384), (1536, 256)]
STREAM_BYTES = 96 << 20


def best(fn, repeats: int) -> float:
    fn()
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = bf16_rows_kernel()
    if kernel is None:
        print("the C kernel is unavailable (TIDAL_CPU_KERNELS=0 or no compiler)")
        return 1
    big = torch.ones(256 << 20, dtype=torch.uint8).view(torch.int64)
    bw = big.numel() * 8 / best(big.sum, args.repeats)
    del big
    print(f"## bf16 GEMV, {args.threads} threads, load {os.getloadavg()[0]:.2f}; read baseline {bw / 1e9:.1f} GB/s")
    print("| N x K | M | C kernel GB/s | of read baseline | torch bf16 GB/s | C / torch |")
    print("|---|---|---|---|---|---|")
    for n, k in SHAPES:
        nbytes = n * k * 2
        copies = [torch.randn(n, k).to(torch.bfloat16) for _ in range(max(1, STREAM_BYTES // nbytes))]
        for m in args.rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            ours = best(lambda: [kernel(x, w) for w in copies], args.repeats) / len(copies)
            theirs = best(lambda: [F.linear(x, w) for w in copies], args.repeats) / len(copies)
            print(f"| {n} x {k} | {m} | {nbytes / ours / 1e9:.1f} | {nbytes / ours / bw:.0%} | "
                  f"{nbytes / theirs / 1e9:.1f} | {theirs / ours:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
