"""MLA decode with kv_b_proj's weight read in place (C) against the torch path, the 223M model's shapes.

    PYTHONPATH=. python benchmarks/bench_mla_absorbed.py [--batches 1 8 32] [--context 256] [--dtype bfloat16]

One layer's absorbed decode (tidal.ops.mla.mla_paged_decode: 6 heads, d_nope = d_v = 128, rope 64,
rank 256, pages of 16) for B sequences of --context cached tokens, with the fused decode kernels on
(csrc/mla_decode.c mla_absorbed_decode) and off (TIDAL_FUSED_DECODE=0: kv_b cast to float32, two
einsums around the C attention), alternated in one process, best of --repeats; CPU seconds of the
process (both threads), robust to a shared machine. The outputs of the two are compared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import tidal  # noqa: F401  (first: its OpenMP wait policy must be set before torch loads libgomp)
import torch

from tidal.ops.mla import mla_paged_decode

HEADS, NOPE, ROPE, V, RANK, PAGE = 6, 128, 64, 128, 256, 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"## MLA absorbed decode, one layer, {args.dtype}, {args.threads} threads, context {args.context}, "
          f"load {os.getloadavg()[0]:.2f}")
    print("| B | torch path (us CPU) | C, kv_b in place (us CPU) | speed-up | max |diff| |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for b in args.batches:
        per_seq = -(-args.context // PAGE)
        pages = torch.randn(b * per_seq + 4, PAGE, RANK + ROPE, generator=gen).to(dtype)
        table = torch.randperm(b * per_seq, generator=gen).view(b, per_seq)
        lengths = torch.full((b,), args.context)
        w = (torch.randn(HEADS * (NOPE + V), RANK, generator=gen) * 0.05).to(dtype)
        q_nope, q_pe = torch.randn(b, HEADS, NOPE + ROPE, generator=gen).to(dtype).split([NOPE, ROPE], -1)
        best, outs = {}, {}
        for rep in range(2 * args.repeats):
            flag = "01"[rep % 2]
            os.environ["TIDAL_FUSED_DECODE"] = flag
            t0 = time.process_time()
            for _ in range(args.calls):
                outs[flag] = mla_paged_decode(q_nope, q_pe, pages, table, lengths, w, 0.1)
            best[flag] = min(best.get(flag, float("inf")), (time.process_time() - t0) / args.calls)
        os.environ.pop("TIDAL_FUSED_DECODE")
        diff = (outs["0"].double() - outs["1"].double()).abs().max().item()
        print(f"| {b} | {best['0'] * 1e6:.0f} | {best['1'] * 1e6:.0f} | {best['0'] / best['1']:.2f}x | {diff:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
