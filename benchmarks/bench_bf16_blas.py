"""Where torch's bfloat16 matmul (oneDNN; AMX tiles where the CPU has them) overtakes tidal's C row
kernels, which sets ``tidal.ops.bf16_blas.MIN_ROWS``; one process, interleaved repeats.

    PYTHONPATH=. python benchmarks/bench_bf16_blas.py
    PYTHONPATH=. python benchmarks/bench_bf16_blas.py --rows 8 16 24 32 64 --threads 2

Two products at each row count, on the shapes of benchmarks/configs/k3-223m.json:
- a trunk projection (768 x 768 and 768 -> 3072, bf16 rows and weight): ``bf16_rows_kernel`` against
  ``F.linear``;
- one packed MXFP4 expert (gate|up 1024 x 384): the C grouped kernel against the bf16 dequantisation
  plus ``F.linear`` that ``mxfp4_moe`` uses for many rows (the dequantisation is counted).
Printed: microseconds, GFLOP/s and the ratio (C time / torch time: above 1, torch wins).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import tidal  # noqa: F401  (first: its OpenMP wait policy must be set before torch loads libgomp)
import torch
import torch.nn.functional as F

from tidal.ops import bf16_blas
from tidal.ops.cpu_kernels import bf16_rows_kernel, mxfp4_dequantize_bf16_kernel, mxfp4_kernels
from tidal.ops.mxfp import quantize_mxfp4
from tidal.ops.mxfp4_table import ExpertTable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kda import best_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 24, 32, 48, 64, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    c_rows, (grouped, _), deq = bf16_rows_kernel(), mxfp4_kernels(), mxfp4_dequantize_bf16_kernel()
    print(f"## {args.threads} threads, AMX tiles: {bf16_blas._amx()}, MIN_ROWS {bf16_blas.MIN_ROWS}, "
          f"load {os.getloadavg()[0]:.2f}")
    print("| product | rows | C us | torch us | C GFLOP/s | torch GFLOP/s | C / torch |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    packed, scales = quantize_mxfp4(torch.randn(1, 1024, 384, generator=gen))
    table = ExpertTable.stacked(packed, scales)
    one = torch.zeros(1, dtype=torch.int64)
    for M in args.rows:
        cases = []
        for N, K in ((768, 768), (3072, 768)):
            w = torch.randn(N, K, generator=gen).bfloat16()
            x = torch.randn(M, K, generator=gen).bfloat16()
            cases.append((f"trunk {K}->{N}", 2 * M * N * K, lambda x=x, w=w: c_rows(x, w), lambda x=x, w=w: F.linear(x, w)))
        x = torch.randn(M, 384, generator=gen).bfloat16()
        offsets = torch.tensor([0, M], dtype=torch.int64)
        cases.append(("expert 384->1024", 2 * M * 1024 * 384, lambda x=x, o=offsets: grouped(x, o, one, table),
                      lambda x=x: F.linear(x, deq(table, 0)).float()))
        for name, flops, c_fn, t_fn in cases:
            tc, tt = [], []
            for _ in range(2):  # interleaved
                tc.append(best_of(c_fn, args.repeats) / 1e3)  # ms -> s
                tt.append(best_of(t_fn, args.repeats) / 1e3)
            c, t = min(tc), min(tt)
            print(f"| {name} | {M} | {c * 1e6:.0f} | {t * 1e6:.0f} | {flops / c / 1e9:.0f} | {flops / t / 1e9:.0f} | "
                  f"{c / t:.2f} |")


if __name__ == "__main__":
    main()
