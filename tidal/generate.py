"""``tidal generate``: offline generation from the command line (the embedded model by default)."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal generate", description=__doc__)
    p.add_argument("prompt", nargs="*", help="prompt text (several = a batch); default: a short Python prompt")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("-q", "--quiet", action="store_true", help="print only the generated text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(name)s: %(message)s",
                        stream=sys.stderr)
    from tidal import LLM, SamplingParams

    prompts = args.prompt or ["def fibonacci(n):"]
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
        llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    except (ValueError, OSError) as e:
        print(f"tidal generate: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_out = 0
    for out in outputs:
        n_out += len(out.outputs[0].token_ids)
        if args.quiet:
            print(out.outputs[0].text)
        else:
            print(f"--- prompt: {out.prompt!r}\n{out.prompt}{out.outputs[0].text}")
    if not args.quiet:
        print(f"--- {n_out} tokens in {elapsed:.2f} s ({n_out / max(elapsed, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
