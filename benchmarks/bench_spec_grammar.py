"""Speculation under a grammar: accept length and decode tokens/s of requests held to a grammar vs free.

The embedded model answers the README's chat example (thinking off) greedily, free and held to
the K3 reply skeleton (``K3Format.reply_grammar(prompt, skeleton=True)``, what the server holds a
reply with no tools declared to), and a JSON prompt held to a schema; each with no speculation,
NGRAM and the shipped DSPARK drafter (the engines as served: the cost policy picks the steps
that speculate), sides interleaved in one process for ``--rounds`` rounds. Printed per engine,
workload and batch size: median output tokens/s (wall time of the batch) and the ratio to the
same workload without speculation, and the chains' mean accept length (committed tokens per
verified chain; "-" where no chain ran).

    python benchmarks/bench_spec_grammar.py [--rounds 3] [--tokens 48] [--threads 1] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tidal import LLM, SamplingParams
from tidal.embedded import embedded_model_dir
from tidal.sampling_params import StructuredOutputsParams
from tidal.serve.chat import K3Format

DSPARK = Path(__file__).resolve().parents[1] / "tidal" / "assets" / "embedded-dspark"
CHAT = [{"role": "user", "content": "Write a Python function that reverses a list."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "steps": {"type": "array", "items": {"type": "string"}, "maxItems": 8}},
          "required": ["name", "steps"], "additionalProperties": False}


def run(llm: LLM, prompt: list[int], batch: int, spec: StructuredOutputsParams | None, tokens: int,
        stop: list[int]) -> tuple[float, int, int]:
    """(output tokens/s, chains verified, tokens they committed) of one greedy batch."""
    params = SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=spec, stop_token_ids=stop,
                            skip_special_tokens=False)
    m = llm.engine.spec.metrics if llm.engine.spec is not None else None
    before = (m.num_chains, m.num_accepted_tokens) if m is not None else (0, 0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": prompt}] * batch, [params] * batch)
    seconds = time.perf_counter() - start
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    if m is None:
        return n / seconds, 0, 0
    chains = m.num_chains - before[0]
    return n / seconds, chains, chains + m.num_accepted_tokens - before[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48, help="tokens per request at most")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(kv_cache_memory_bytes=64_000_000, enable_prefix_caching=False)
    engines = {"plain": LLM(embedded_model_dir(), **common),
               "NGRAM": LLM(embedded_model_dir(), speculative_algorithm="NGRAM", **common)}
    if DSPARK.exists():
        engines["DSPARK"] = LLM(embedded_model_dir(), speculative_algorithm="DSPARK",
                                speculative_draft_model_path=str(DSPARK), **common)
    fmt = K3Format()
    tok = engines["plain"].engine.tokenizer
    stop = fmt.stop_token_ids(tok)
    chat = fmt.render(CHAT, thinking="off")
    json_prompt = fmt.render([{"role": "user", "content": "Describe how to reverse a list, as JSON."}],
                             thinking="off")
    cases = {"chat free": (chat.token_ids(tok), None),
             "chat skeleton": (chat.token_ids(tok), StructuredOutputsParams(llguidance=fmt.reply_grammar(chat, skeleton=True))),
             "json schema": (json_prompt.token_ids(tok), StructuredOutputsParams(json=SCHEMA))}
    print("output tok/s (median of", args.rounds, "interleaved rounds), x = / plain engine on the same case; "
          "accept length = committed tokens per chain")
    for batch in args.batches:
        rates: dict[tuple[str, str], list[float]] = {}
        accept: dict[tuple[str, str], list[int]] = {}
        for llm in engines.values():  # warm: grammars compiled, this batch size run once
            for prompt, spec in cases.values():
                run(llm, prompt, batch, spec, 4, stop)
        for r in range(args.rounds):
            order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
            for case, (prompt, spec) in cases.items():
                for name, llm in order:
                    rate, chains, committed = run(llm, prompt, batch, spec, args.tokens, stop)
                    rates.setdefault((name, case), []).append(rate)
                    a = accept.setdefault((name, case), [0, 0])
                    a[0] += chains
                    a[1] += committed
        for case in cases:
            base = statistics.median(rates[("plain", case)])
            for name in engines:
                rate = statistics.median(rates[(name, case)])
                chains, committed = accept[(name, case)]
                al = f"{committed / chains:.2f} ({chains} chains)" if chains else "-"
                print(f"  batch {batch} {case:13s} {name:6s}: {rate:7.1f} tok/s = {rate / base:.2f}x  accept length {al}")


if __name__ == "__main__":
    main()
