"""The CPU GEMM kernels of two source trees, A/B in one process: bf16 trunk GEMV and packed MXFP4 experts.

    PYTHONPATH=. python benchmarks/bench_kernel_ab.py --rev c6f4c86        # that commit's csrc vs this tree's
    PYTHONPATH=. python benchmarks/bench_kernel_ab.py --rev main --threads 2 --clock wall

``csrc`` of --rev (``git show``) and of the working tree are each built as tidal builds them
(cc -O3 -march=native -fopenmp) and called through ctypes on the same inputs, alternating A, B, A,
B ... (best of --repeats each), so drift in the machine's load hits both. Shapes are the 223M
model's (benchmarks/configs/k3-223m.json): bf16 weights N x K times M rows, streamed from enough
copies to exceed the L3; the routed experts of one MoE layer (32 experts, top-4, 384 -> 2 x 512 ->
384) for T tokens, cycled over 8 layers' weights. The outputs of A and B are compared bitwise.

--clock cpu (default) times the process's CPU seconds with one thread: the kernel's own cost,
robust to a shared machine. --clock wall with --threads 2 is what a decode step sees.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tidal  # noqa: F401  (first: its OpenMP wait policy must be set before torch loads libgomp)
import torch

from tidal.ops.cpu_kernels import CSRC, FLAGS

ROOT = Path(__file__).resolve().parent.parent
GEMV_SHAPES = [(32000, 768), (4608, 768), (2048, 768), (1024, 768), (768, 768), (1152, 384)]
E, D, INTER, TOP_K, LAYERS = 32, 384, 512, 4, 8
STREAM_BYTES = 96 << 20


def build(tree: Path, name: str, out: Path) -> ctypes.CDLL:
    subprocess.run([os.environ.get("CC", "cc"), *FLAGS, str(tree / f"{name}.c"), "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def source_tree(rev: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    rel = CSRC.relative_to(ROOT)
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{rel}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for n in names:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}/{n}"], check=True, capture_output=True)
        (dest / n).write_bytes(blob.stdout)
    return dest


def best(fn, repeats: int, clock) -> float:
    fn()
    out = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        out = min(out, clock() - t0)
    return out


def p(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="main", help="the A side: a git revision of this repository")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"A": source_tree(args.rev, Path(tmp) / "a"), "B": CSRC}
        libs = {k: {n: build(t, n, Path(tmp) / f"{k}-{n}.so") for n in ("bf16_gemm", "mxfp4_gemm")}
                for k, t in trees.items()}
        print(f"## A = {args.rev}'s csrc, B = this tree's; {args.threads} thread(s), {args.clock} time, "
              f"load {os.getloadavg()[0]:.2f}")
        print("| kernel | shape | A | B | A / B | bitwise equal |")
        print("|---|---|---|---|---|---|")
        for n, k in GEMV_SHAPES:
            ws = [torch.randn(n, k).to(torch.bfloat16) for _ in range(max(1, STREAM_BYTES // (n * k * 2)))]
            for m in args.rows:
                x = torch.randn(m, k)
                outs = {key: torch.empty(m, n) for key in libs}

                def gemv(key: str) -> None:
                    fn = libs[key]["bf16_gemm"].bf16_gemm
                    fn.argtypes, fn.restype = [vp, i64, i64, vp, i64, i64, vp, ctypes.c_int], None
                    for w in ws:
                        fn(p(x), m, k, p(w), k, n, p(outs[key]), args.threads)

                t = {key: float("inf") for key in libs}
                for _ in range(args.repeats):
                    for key in libs:
                        t[key] = min(t[key], best(lambda: gemv(key), 1, clock) / len(ws))
                gbs = {key: n * k * 2 / t[key] / 1e9 for key in libs}
                print(f"| bf16 GEMV | {n} x {k}, M = {m} | {gbs['A']:.1f} GB/s | {gbs['B']:.1f} GB/s | "
                      f"{t['A'] / t['B']:.2f}x | {torch.equal(outs['A'], outs['B'])} |")
        gen = torch.Generator().manual_seed(0)
        w13 = torch.randint(0, 256, (LAYERS, E, 2 * INTER, D // 2), generator=gen, dtype=torch.uint8)
        s13 = torch.randint(120, 128, (LAYERS, E, 2 * INTER, D // 32), generator=gen, dtype=torch.uint8)
        w2 = torch.randint(0, 256, (LAYERS, E, D, INTER // 2), generator=gen, dtype=torch.uint8)
        s2 = torch.randint(120, 128, (LAYERS, E, D, INTER // 32), generator=gen, dtype=torch.uint8)
        # the kernel's expert_rows tables: each expert's first row and first scale byte, by address
        tables = [[torch.tensor([t[layer, e].data_ptr() for e in range(E)], dtype=torch.int64)
                   for t in (w13, s13, w2, s2)] for layer in range(LAYERS)]
        for T in args.tokens:
            h = torch.randn(T, D, generator=gen)
            ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)])
            wts = torch.rand(T, TOP_K, generator=gen)
            outs = {key: torch.empty(T, D) for key in libs}

            def experts(key: str) -> None:
                fn = libs[key]["mxfp4_gemm"].mxfp4_moe_tokens
                fn.argtypes = [vp, i64, ctypes.c_int, i64, i64, vp, vp, i64, i64, vp, vp, i64, i64, i64, i64, vp, vp,
                               i64, i64, ctypes.c_int, ctypes.c_float, ctypes.c_float, vp, ctypes.c_int]
                fn.restype = ctypes.c_int
                for layer in range(LAYERS):
                    fn(p(h), D, 0, T, D, p(ids), p(wts), TOP_K, E, p(tables[layer][0]), p(tables[layer][1]), 1,
                       D // 2, D // 32, INTER, p(tables[layer][2]), p(tables[layer][3]), INTER // 2, INTER // 32, 1,
                       4.0, 25.0, p(outs[key]), args.threads)

            t = {key: float("inf") for key in libs}
            for _ in range(args.repeats):
                for key in libs:
                    t[key] = min(t[key], best(lambda: experts(key), 1, clock) / LAYERS)
            print(f"| packed experts (one layer) | T = {T} tokens, top-{TOP_K} of {E} | {t['A'] * 1e6:.0f} us | "
                  f"{t['B'] * 1e6:.0f} us | {t['A'] / t['B']:.2f}x | {torch.equal(outs['A'], outs['B'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
