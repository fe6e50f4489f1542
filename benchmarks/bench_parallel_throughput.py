"""Offline throughput on this machine: TP 1 with one thread (the baseline), TP 1 with N threads and
TP N with one thread per rank, the same prompts, in one command.

    python benchmarks/bench_parallel_throughput.py                  # N = 2, 16 prompts x 64 tokens
    python benchmarks/bench_parallel_throughput.py --tp-size 2 --concurrency 1 16 --output-len 32

Greedy, exactly --output-len tokens each (ignore_eos), all prompts submitted at once to
``LLM.generate``; the first run of each engine warms it and is not counted. Output tokens per
second of the best of --repeats runs, each as a ratio to TP 1 x 1 thread, and whether the greedy
tokens equal the baseline's (float32: the all-reduce order changes the sums, so a near tie may
flip). Prints the load average before and after: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tidal

import torch  # noqa: E402

from tidal import LLM, SamplingParams  # noqa: E402
from tidal.embedded import embedded_model_dir  # noqa: E402


def run(llm: LLM, prompts: list[dict], params: SamplingParams, repeats: int) -> tuple[float, list]:
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    best, tokens = 0.0, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / dt)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    return best, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    ckpt = str(args.model_dir or embedded_model_dir())
    n = args.tp_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    kw = dict(dtype=args.dtype, skip_tokenizer_init=True, kv_cache_memory_bytes=256 << 20)
    results = {}
    before = os.getloadavg()
    for c in args.concurrency:
        prompts = [{"prompt_token_ids": [(31 * i + 7 * t) % 4000 + 10 for t in range(args.prompt_len)]} for i in range(c)]
        row = []
        for threads in (1, n):
            torch.set_num_threads(threads)
            one = LLM(ckpt, **kw)
            row.append(run(one, prompts, params, args.repeats))
            del one
        torch.set_num_threads(1)  # the core samples; each rank process runs one thread
        many = LLM(ckpt, tp_size=n, **kw)
        try:
            row.append(run(many, prompts, params, args.repeats))
        finally:
            many.close()
        results[c] = row
    after = os.getloadavg()
    print(f"\n{ckpt}, {args.dtype}, prompts of {args.prompt_len} tokens, {args.output_len} output tokens each; "
          f"load average {before[0]:.2f} before, {after[0]:.2f} after, on {os.cpu_count()} CPUs")
    names = ["TP 1 x 1 thread", f"TP 1 x {n} threads", f"TP {n} x 1 thread"]
    print(f"{'C':>4}" + "".join(f"{name:>22}" for name in names) + "  same tokens as TP 1 x 1")
    for c, row in results.items():
        base, base_tokens = row[0]
        cells = "".join(f"{tps:>10.1f} tok/s {tps / base:>5.2f}x" for tps, _ in row)
        same = " ".join("yes" if tokens == base_tokens else "NO" for _, tokens in row[1:])
        print(f"{c:>4}{cells}  {same}")


if __name__ == "__main__":
    main()
