"""The cost and the effect of --enable-deterministic-inference, on the embedded model in bfloat16.

    python benchmarks/bench_deterministic.py [--requests 16] [--max-tokens 24] [--chunk 64]

For each mode (default, deterministic) the same greedy requests run twice: each alone (one at a
time, prefix caching off), then all at once with chunked prefill of --chunk tokens and prefix
caching on, the later half extending the earlier prompts (prefix-cache hits). Printed per mode:
how many requests' tokens differ between the two runs, and the wall time of the batched run; then
the ratio deterministic / default of those times (same command, same machine, one thread).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tidal import LLM, SamplingParams


def workload(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    first = [[rng.randrange(300, 8000) for _ in range(rng.randint(16, 160))] for _ in range(count - count // 2)]
    later = [first[i % len(first)] + [rng.randrange(300, 8000) for _ in range(rng.randint(1, 40))]
             for i in range(count // 2)]
    return first + later


def run(deterministic: bool, prompts: list[list[int]], params: SamplingParams, chunk: int) -> tuple[int, float]:
    """(requests whose batched tokens differ from their solo tokens, batched wall seconds)."""
    solo_llm = LLM(None, dtype="bfloat16", enable_prefix_caching=False, skip_tokenizer_init=True,
                   enable_deterministic_inference=deterministic)
    solo = [solo_llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
    del solo_llm
    llm = LLM(None, dtype="bfloat16", max_num_batched_tokens=chunk, skip_tokenizer_init=True,
              enable_deterministic_inference=deterministic)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))  # warm-up, no shared prefix
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    differ = sum(o.outputs[0].token_ids != s for o, s in zip(outs, solo))
    return differ, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = workload(args.requests)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens = sum(len(p) for p in prompts) + args.requests * args.max_tokens
    results = {}
    for mode in ("default", "deterministic"):
        differ, seconds = run(mode == "deterministic", prompts, params, args.chunk)
        results[mode] = seconds
        print(f"{mode:>13}: {differ}/{len(prompts)} requests' greedy tokens differ batched vs alone; "
              f"batched run {seconds:.2f} s ({tokens / seconds:.0f} tokens/s)")
    print(f"deterministic / default batched time: {results['deterministic'] / results['default']:.2f}x")


if __name__ == "__main__":
    main()
