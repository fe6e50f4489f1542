"""Grammar overhead per generated token, against unconstrained decoding in the same run.

Two views, each at batch 1 and 32:

1. sampler: one ``sample()`` call over the embedded model's vocabulary (8192) on random logits,
   with no constraint, with a JSON schema, and with the K3 tool-call reply grammar; the matchers
   advance on every sampled token, so the masks are those of a real walk through the grammar.
2. engine: the embedded model decoding (``LLM.generate``) with and without the JSON schema; the
   per-token cost is the difference of the wall times per generated token.

    python benchmarks/bench_grammar.py [--steps 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tidal.embedded import embedded_model_dir
from tidal.engine.grammar import GrammarCompiler
from tidal.engine.sampler import SampleRow, sample
from tidal.sampling_params import SamplingParams, StructuredOutputsParams
from tidal.serve.chat.constraints import reply_grammar
from tidal.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
                                                                                 "items": {"type": "string"}}},
          "required": ["name", "tags"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]


def time_sampler(compiler: GrammarCompiler, spec: StructuredOutputsParams | None, batch: int, steps: int,
                 vocab: int) -> float:
    """Median seconds of one sample() call for ``batch`` rows."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    cons = [compiler.compile(spec).matcher((2,)) if spec is not None else None for _ in range(batch)]
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        rows = [SampleRow(params, constraint=c) for c in cons]
        t0 = time.perf_counter()
        out = sample(logits, rows)
        for c, r in zip(cons, out):
            if c is not None:
                c.accept(r.token_id)
        times.append(time.perf_counter() - t0)
        if spec is not None and any(c.finished for c in cons):  # restart a walk that ended
            cons = [compiler.compile(spec).matcher((2,)) if c.finished else c for c in cons]
    return statistics.median(times)


def time_engine(llm, spec: StructuredOutputsParams | None, batch: int, tokens: int) -> float:
    """Wall seconds per generated token (all rows) of a decode-dominated run."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True, structured_outputs=spec)
    prompts = [f"def f{i}(x):" for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt / sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64, help="sampler steps per case")
    ap.add_argument("--tokens", type=int, default=32, help="engine: tokens per request")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(embedded_model_dir())
    compiler = GrammarCompiler(tok, (2, 1))
    V = tok.vocab_size
    cases = {"none": None, "json schema": StructuredOutputsParams(json=SCHEMA),
             "K3 tool reply": StructuredOutputsParams(llguidance=reply_grammar(thinking=True, tools=TOOLS,
                                                                               tool_choice="required"))}
    print(f"sampler, vocabulary {V}: median us per step (per token)")
    for batch in (1, 32):
        base = time_sampler(compiler, None, batch, args.steps, V)
        for name, spec in cases.items():
            t = base if spec is None else time_sampler(compiler, spec, batch, args.steps, V)
            print(f"  batch {batch:2d}  {name:14s} {t * 1e6:9.0f} us/step  {t / batch * 1e6:7.1f} us/token"
                  f"  +{(t - base) / batch * 1e6:7.1f} us/token vs none  ({t / base:.2f}x)")
    from tidal import LLM

    llm = LLM(kv_cache_memory_bytes=64_000_000)
    print("engine (embedded model, decode): ms per generated token")
    for batch in (1, 32):
        base = time_engine(llm, None, batch, args.tokens)
        t = time_engine(llm, cases["json schema"], batch, args.tokens)
        print(f"  batch {batch:2d}  none {base * 1e3:7.2f}  json schema {t * 1e3:7.2f}  "
              f"overhead {(t - base) * 1e3:+.2f} ms/token ({t / base:.2f}x)")


if __name__ == "__main__":
    main()
