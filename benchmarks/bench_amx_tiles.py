"""The bf16 trunk's products on the AMX-BF16 tiles (csrc/amx_tiles.h) against the FMA register tiles
(csrc/row_tiles.h), on the benchmark model's shapes, in one run.

    python benchmarks/bench_amx_tiles.py [--rows 1 8 16 32 64] [--threads 2] [--repeats 5] [--streamed]

Each product is bfloat16 rows times bfloat16 weights side by side (``bf16_rows_kernel`` / the parts
kernel, as the fused layer steps call them), timed with the tile path off and on (the switch flipped
between calls, the two interleaved, best of --repeats rounds of calls totalling ~20 ms). Printed per
shape and row count: GFLOP/s of each and the ratio FMA time / AMX time (above 1: the tiles are
faster). The weights stay in cache from call to call; ``--streamed`` cycles each call through
copies of them spread over 512 MiB, as a decode step reads its weights from memory. Then the packed
MXFP4 experts' gate|up product (32 experts of 1024 x 384, the model's w13) at --expert-rows bfloat16
rows per expert, the same way (groups of fewer than 4 rows keep the FMA tiles either way).
"""

from __future__ import annotations

import argparse
import time

import torch

from tidal.ops import cpu_kernels

# (name, input width, output widths of the parts): benchmarks/configs/k3-223m.json's trunk products
SHAPES = [
    ("kda in (q|k|v|f_a|gate|b)", 768, (768, 768, 768, 128, 768, 6)),
    ("kda f_b", 128, (768,)),
    ("kda/mla o_proj", 768, (768,)),
    ("mla in (q_a|kv_a|gate)", 768, (384, 320, 768)),
    ("mla q_b", 384, (1152,)),
    ("moe latent down", 768, (384,)),
    ("moe latent up", 384, (768,)),
    ("shared gate|up", 768, (512, 512)),
    ("shared down", 512, (768,)),
]


def seconds_per_call(fn, x: torch.Tensor, copies: list[cpu_kernels.WeightParts], calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(x, copies[i % len(copies)])
    return (time.perf_counter() - start) / calls


def weight_copies(K: int, ns: tuple[int, ...], pool: torch.Tensor | None) -> list[cpu_kernels.WeightParts]:
    """One set of parts [n, K] of random bfloat16, or (pool) as many sets as fit in it, side by side."""
    if pool is None:
        return [cpu_kernels.WeightParts(tuple(torch.randn(n, K).bfloat16() for n in ns))]
    size = sum(ns) * K
    copies = []
    for start in range(0, pool.numel() - size + 1, size):
        views, at = [], start
        for n in ns:
            views.append(pool[at : at + n * K].view(n, K))
            at += n * K
        copies.append(cpu_kernels.WeightParts(tuple(views)))
    return copies


def experts(rows_per_expert: list[int], repeats: int) -> None:
    """The grouped MXFP4 product of 32 random experts [1024, 384], every expert given the same rows."""
    gemm = cpu_kernels.mxfp4_kernels()[0]
    E, N, K = 32, 1024, 384
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8)
    scales = torch.randint(118, 131, (E, N, K // 32), dtype=torch.uint8)
    print(f"\n{'experts gate|up':28s} {'rows':>4s} {'FMA ms':>9s} {'AMX ms':>9s} {'AMX/FMA':>8s}")
    for per in rows_per_expert:
        offsets, ids = torch.arange(E + 1) * per, torch.arange(E)
        x = torch.randn(E * per, K).bfloat16()
        best = {0: float("inf"), 1: float("inf")}
        for _ in range(repeats):
            for amx in (0, 1):
                cpu_kernels.set_amx_rows(cpu_kernels.AMX_MIN_ROWS if amx else 0)
                start = time.perf_counter()
                for _ in range(5):
                    gemm(x, offsets, ids, packed, scales)
                best[amx] = min(best[amx], (time.perf_counter() - start) / 5)
        print(f"{'32 x 1024x384 MXFP4':28s} {per:4d} {best[0] * 1e3:9.2f} {best[1] * 1e3:9.2f} "
              f"{best[0] / best[1]:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--streamed", action="store_true", help="weights read from memory, not cache")
    ap.add_argument("--expert-rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gemm = cpu_kernels.bf16_parts_kernel()
    if gemm is None or cpu_kernels.set_amx_rows(1) == 0:
        raise SystemExit("needs the C kernels and AMX tiles (TIDAL_CPU_KERNELS, TIDAL_CPU_PORTABLE, the CPU)")
    torch.manual_seed(0)
    pool = torch.empty(256 << 20, dtype=torch.bfloat16).normal_() if args.streamed else None
    print(f"{'product':28s} {'rows':>4s} {'FMA GF/s':>9s} {'AMX GF/s':>9s} {'AMX/FMA':>8s}")
    totals = {0: 0.0, 1: 0.0}
    for name, K, ns in SHAPES:
        copies = weight_copies(K, ns, pool)
        for M in args.rows:
            x = torch.randn(M, K).bfloat16()
            flops = 2 * M * K * copies[0].total
            calls = max(3, int(2e-2 / max(flops / 100e9, 1e-6)))
            calls = max(calls, len(copies)) if pool is not None else calls
            best = {0: float("inf"), 1: float("inf")}
            for _ in range(args.repeats):
                for amx in (0, 1):
                    cpu_kernels.set_amx_rows(amx)
                    best[amx] = min(best[amx], seconds_per_call(gemm, x, copies, calls))
            for amx in (0, 1):
                totals[amx] += best[amx]
            print(f"{name:28s} {M:4d} {flops / best[0] / 1e9:9.1f} {flops / best[1] / 1e9:9.1f} "
                  f"{best[0] / best[1]:8.2f}")
    print(f"all products, all row counts: AMX/FMA time ratio {totals[0] / totals[1]:.2f} (above 1: faster)")
    experts(args.expert_rows, args.repeats)
    cpu_kernels.set_amx_rows(cpu_kernels.amx_rows_setting())


if __name__ == "__main__":
    main()
