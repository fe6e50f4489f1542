"""What holding a chat reply with no tools declared to the K3 skeleton grammar costs per token.

The server holds such a reply to ``K3Format.reply_grammar(prompt, skeleton=True)`` (no
``tools`` element), so the embedded model cannot call a tool nobody declared. This measures a
plain chat request (the README's chat example at thinking off and at effort low) decoded by the embedded model with that grammar and without it, interleaved in one
process: inter-token latency (the engine's own gaps between a request's tokens) at batch 1 and 8,
each side run ``--rounds`` times in alternation, medians and their ratio. ``--dspark`` adds the
same A/B with the shipped DSPARK drafter (a constrained request speculates too: its drafts are
cut where the grammar rejects them, see benchmarks/bench_spec_grammar.py for accept lengths).

    python benchmarks/bench_no_tools_grammar.py [--rounds 5] [--tokens 32] [--threads 1] [--dspark]
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

# The README's chat example: its reply (code, or thinking then code) outlasts --tokens.
CHATS = (
    ([{"role": "user", "content": "Write a Python function that reverses a list."}], "off"),
    ([{"role": "user", "content": "Write a Python function that reverses a list."}], "low"),
)
DSPARK = Path(__file__).resolve().parents[1] / "tidal" / "assets" / "embedded-dspark"


def itl(llm: LLM, prompts: list[list[int]], spec: StructuredOutputsParams | None, tokens: int,
        stop: list[int]) -> tuple[float, float]:
    """(median seconds between consecutive tokens of a request, mean tokens per request) of one
    batch, sampled as a chat client would (a row ends at the format's stop token or ``tokens``).
    The prompts are chosen so that rows run their full length on both sides: the batch holds
    the same rows at every step, free or held to the grammar."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=tokens, structured_outputs=spec,
                             stop_token_ids=stop, skip_special_tokens=False) for s in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    gaps = [g for o in outs for g in o.metrics.inter_token_times]
    return statistics.median(gaps), statistics.mean(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternations of free / constrained per case")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per request")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dspark", action="store_true", help="also with the shipped DSPARK drafter")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fmt = K3Format()
    engines = {"plain": LLM(embedded_model_dir(), kv_cache_memory_bytes=64_000_000, enable_prefix_caching=False)}
    if args.dspark:
        engines["DSPARK"] = LLM(embedded_model_dir(), kv_cache_memory_bytes=64_000_000, enable_prefix_caching=False,
                                speculative_algorithm="DSPARK", speculative_draft_model_path=str(DSPARK))
    tok = engines["plain"].engine.tokenizer
    stop = fmt.stop_token_ids(tok)
    print("ms per decoded token, medians of", args.rounds, "alternating rounds (grammar / free = ratio)")
    for name, llm in engines.items():
        for msgs, effort in CHATS:
            prompt = fmt.render(msgs, thinking=effort)
            spec = StructuredOutputsParams(llguidance=fmt.reply_grammar(prompt, skeleton=True))
            ids = prompt.token_ids(tok)
            for batch in (1, 8):
                itl(llm, [ids] * batch, spec, 4, stop)  # warm: compile the grammar, this batch size
                free, held, lens = [], [], {"free": [], "grammar": []}
                for r in range(args.rounds):
                    order = ((free, None), (held, spec)) if r % 2 == 0 else ((held, spec), (free, None))
                    for out, s in order:
                        gap, n = itl(llm, [ids] * batch, s, args.tokens, stop)
                        out.append(gap)
                        lens["free" if s is None else "grammar"].append(n)
                f, h = statistics.median(free), statistics.median(held)
                print(f"  {name:6s} effort {effort:3s} batch {batch}: free {f * 1e3:6.2f}  grammar {h * 1e3:6.2f}"
                      f"  = {h / f:.3f}x  (free {min(free) * 1e3:.2f}-{max(free) * 1e3:.2f}, grammar "
                      f"{min(held) * 1e3:.2f}-{max(held) * 1e3:.2f}; tokens per request "
                      f"{statistics.mean(lens['free']):.1f} / {statistics.mean(lens['grammar']):.1f})")


if __name__ == "__main__":
    main()
