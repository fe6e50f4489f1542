"""Speculative decoding on the embedded model: decode tokens/s with and without speculation at
several concurrencies, in the same run, and the accept length.

Workloads (greedy, ``ignore_eos``):
- ``repeat``: prompts that repeat their own context (a Python source file of the standard library
  quoted back: the prompt is the file's first lines, then those lines again up to a point), the
  case prompt lookup (NGRAM) is for;
- ``chat``: short chat-like prompts with no repeated context.

Decode tok/s counts the tokens emitted by steps without prefill work and divides by those steps'
wall time (prefill is the same with and without speculation). Each (concurrency, setting) runs
``--repeats`` times and the best is kept (the machine is shared and noisy).

    python benchmarks/bench_spec.py [--concurrency 1 8 32] [--k 4] [--tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time

import torch

from tidal import LLM, SamplingParams

CHAT = ["Tell me about the ocean.", "What is a good name for a cat?", "Explain recursion briefly.",
        "Write a haiku about autumn.", "How do I boil an egg?", "Why is the sky blue?",
        "List three prime numbers.", "What does a compiler do?"]


def repeat_prompts(tok, n: int, lines: int = 14) -> list[str]:
    """Source files quoted back: the first ``lines`` lines, a blank line, then the same lines cut
    after their third line (the model continues copying)."""
    import collections, textwrap  # noqa: E401 - sources of plain text that ships with Python
    files = [inspect.getsourcefile(m) for m in (collections, textwrap, json, argparse, inspect, os.path)]
    out = []
    for i in range(n):
        with open(files[i % len(files)]) as f:
            text = f.read().splitlines()
        start = 40 + 23 * (i // len(files))
        body = [line for line in text[start : start + lines]]
        out.append("\n".join(body) + "\n\n" + "\n".join(body[:3]) + "\n")
    return out


def run(llm: LLM, prompts: list[str], tokens: int) -> tuple[float, int, float | None]:
    """(decode tok/s, decode tokens, accept length of this run's chains or None)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        enc = llm.tokenizer.encode(p)
        engine.add_request(f"r{time.monotonic_ns()}_{i}", list(getattr(enc, "ids", enc)), params)
    spec0 = (engine.spec.metrics.num_chains, engine.spec.metrics.avg_accept_length * engine.spec.metrics.num_chains) \
        if engine.spec else None
    decode_s, decode_tokens = 0.0, 0
    while engine.has_unfinished_requests():
        prefill = any(r.num_uncomputed > 1 for r in engine.scheduler.running) or bool(engine.scheduler.waiting)
        before = engine.metrics().generation_tokens
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if not prefill:
            decode_s += dt
            decode_tokens += engine.metrics().generation_tokens - before
    accept = None
    if engine.spec is not None:
        m = engine.spec.metrics
        chains = m.num_chains - spec0[0]
        accept = (m.avg_accept_length * m.num_chains - spec0[1]) / chains if chains else None
    return decode_tokens / decode_s if decode_s else 0.0, decode_tokens, accept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--k", type=int, default=4, help="speculative_num_draft_tokens")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workloads", nargs="+", default=["repeat", "chat"])
    ap.add_argument("--replay", action="store_true", help="--enable-linear-replayssm-spec")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plain = LLM(enable_prefix_caching=False)
    spec = LLM(enable_prefix_caching=False, speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.k,
               enable_linear_replayssm_spec=args.replay)
    print(f"embedded model, float32, {args.threads} thread(s), NGRAM k={args.k}, "
          f"rollback {spec.engine.spec.config.rollback}, speculation backs off above "
          f"{spec.engine.spec.config.max_spec_batch} sequences")
    print(f"{'workload':9} {'conc':>4} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'accept len':>10}")
    for work in args.workloads:
        for conc in args.concurrency:
            prompts = repeat_prompts(plain.tokenizer, conc) if work == "repeat" else \
                [CHAT[i % len(CHAT)] for i in range(conc)]
            run(plain, prompts[:1], 4)  # warm-up
            run(spec, prompts[:1], 4)
            best_plain = max(run(plain, prompts, args.tokens)[0] for _ in range(args.repeats))
            spec_runs = [run(spec, prompts, args.tokens) for _ in range(args.repeats)]
            best_spec = max(r[0] for r in spec_runs)
            accept = spec_runs[-1][2]
            print(f"{work:9} {conc:>4} {best_plain:>12.1f} {best_spec:>11.1f} {best_spec / best_plain:>6.2f} "
                  f"{'-' if accept is None else f'{accept:.2f}':>10}", flush=True)


if __name__ == "__main__":
    main()
