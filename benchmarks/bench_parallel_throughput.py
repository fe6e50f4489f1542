"""Offline throughput on this machine: TP 1 with N threads against TP N with one thread per rank,
the same prompts, in one command.

    python benchmarks/bench_parallel_throughput.py                  # N = 2, 16 prompts x 64 tokens
    python benchmarks/bench_parallel_throughput.py --tp-size 2 --concurrency 1 16 --output-len 32

Greedy, exactly --output-len tokens each (ignore_eos), all prompts submitted at once to
``LLM.generate``; the first run of each engine warms it and is not counted. Output tokens per
second of the best of --repeats runs, and whether the greedy tokens of both are equal (float32:
the all-reduce order changes the sums, so a near tie may flip). Prints the load average too: the
machine is shared.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from tidal import LLM, SamplingParams
from tidal.embedded import embedded_model_dir


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
    for c in args.concurrency:
        prompts = [{"prompt_token_ids": [(31 * i + 7 * t) % 4000 + 10 for t in range(args.prompt_len)]} for i in range(c)]
        torch.set_num_threads(n)
        one = LLM(ckpt, **kw)
        tp1, tok1 = run(one, prompts, params, args.repeats)
        del one
        torch.set_num_threads(1)  # the core samples; each rank process runs one thread
        many = LLM(ckpt, tp_size=n, **kw)
        try:
            tpn, tokn = run(many, prompts, params, args.repeats)
        finally:
            many.close()
        results[c] = (tp1, tpn, tok1 == tokn)
    load = os.getloadavg()
    print(f"\n{ckpt}, {args.dtype}, prompts of {args.prompt_len} tokens, {args.output_len} output tokens each; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'C':>4}{f'TP 1 x {n} threads':>20}{f'TP {n} x 1 thread':>20}{'ratio':>8}  same tokens")
    for c, (tp1, tpn, same) in results.items():
        print(f"{c:>4}{tp1:>14.1f} tok/s{tpn:>14.1f} tok/s{tpn / tp1:>8.2f}  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
