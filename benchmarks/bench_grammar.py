"""Grammar overhead per generated token, against unconstrained decoding in the same run.

Two views, each at batch 1 and 32, for the chat format chosen by ``--format``:

1. sampler: one ``sample()`` call over an 8192-token vocabulary on random logits, with no
   constraint, with a JSON schema, and with the format's tool-call reply grammar; the matchers
   advance on every sampled token, so the masks are those of a real walk through the grammar.
2. engine: a model decoding (``LLM.generate``) with no constraint, the JSON schema and the reply
   grammar; the per-token cost is the difference of the wall times per generated token.

``k3``: the embedded model and its tokenizer. ``k2``: the embedded tokenizer's BPE with its
special tokens renamed to the K2 format's (same vocabulary size, so the figures compare), and a
random-weight Kimi Linear model of the embedded model's width and depth.

    python benchmarks/bench_grammar.py [--format k3|k2] [--steps 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tidal.embedded import K2_SPECIAL_TOKENS, embedded_model_dir
from tidal.engine.grammar import GrammarCompiler
from tidal.engine.sampler import SampleRow, sample
from tidal.sampling_params import SamplingParams, StructuredOutputsParams
from tidal.serve.chat import chat_format_for
from tidal.serve.chat.prompt import RenderedPrompt
from tidal.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
                                                                                 "items": {"type": "string"}}},
          "required": ["name", "tags"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]


def write_k2_twin(out: Path) -> Path:
    """The embedded tokenizer with K2's special tokens in place of K3's (ids 0..14, ``[UNK]``
    left out), and a random Kimi Linear model at the embedded model's size."""
    from tidal.config import ModelConfig
    from tidal.model.checkpoint import save_model
    from tidal.model.init import init_weights
    from tidal.model.kimi import KimiForCausalLM
    from tidal.presets import tiny_kimi_linear_dict

    src = embedded_model_dir()
    spec = json.loads((src / "tokenizer.json").read_text())
    names = [t for t in K2_SPECIAL_TOKENS if t != "[UNK]"]
    renamed = {}
    for added in spec["added_tokens"]:
        renamed[added["content"]] = names[added["id"]]
        added["content"] = names[added["id"]]
    spec["model"]["vocab"] = {renamed.get(k, k): v for k, v in spec["model"]["vocab"].items()}
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[BOS]", "eos_token": "[EOS]",
                                                           "pad_token": "[PAD]"}))
    vocab = len(spec["model"]["vocab"])
    d = tiny_kimi_linear_dict(hidden_size=256, num_layers=8, vocab_size=vocab, num_experts=32, top_k=2)
    d.update(bos_token_id=names.index("[BOS]"), eos_token_id=names.index("[EOS]"), pad_token_id=names.index("[PAD]"))
    save_model(init_weights(KimiForCausalLM(ModelConfig.from_dict(d)), seed=0), out, dtype=torch.float32)
    return out


def time_sampler(compiler: GrammarCompiler, spec: StructuredOutputsParams | None, batch: int, steps: int,
                 vocab: int, stop: tuple[int, ...]) -> float:
    """Median seconds of one sample() call for ``batch`` rows."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    cons = [compiler.compile(spec).matcher(stop) if spec is not None else None for _ in range(batch)]
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
            cons = [compiler.compile(spec).matcher(stop) if c.finished else c for c in cons]
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
    ap.add_argument("--format", choices=("k3", "k2"), default="k3", help="chat format (and model) to measure")
    ap.add_argument("--steps", type=int, default=64, help="sampler steps per case")
    ap.add_argument("--tokens", type=int, default=32, help="engine: tokens per request")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = embedded_model_dir() if args.format == "k3" else write_k2_twin(Path(tempfile.mkdtemp()))
    tok = load_tokenizer(model_dir)
    fmt = chat_format_for(tok, json.loads((model_dir / "config.json").read_text()))
    stop = tuple(fmt.stop_token_ids(tok))
    compiler = GrammarCompiler(tok, stop)
    V = tok.vocab_size
    # Thinking on: the K3 reply opens inside reasoning, the K2 one may open <think>.
    reply = fmt.reply_grammar(RenderedPrompt(thinking=True, may_think=True), tools=TOOLS, tool_choice="required")
    cases = {"none": None, "json schema": StructuredOutputsParams(json=SCHEMA),
             f"{args.format.upper()} tool reply": StructuredOutputsParams(llguidance=reply)}
    print(f"format {fmt.name}; sampler, vocabulary {V}: median us per step (per token)")
    for batch in (1, 32):
        base = time_sampler(compiler, None, batch, args.steps, V, stop)
        for name, spec in cases.items():
            t = base if spec is None else time_sampler(compiler, spec, batch, args.steps, V, stop)
            print(f"  batch {batch:2d}  {name:14s} {t * 1e6:9.0f} us/step  {t / batch * 1e6:7.1f} us/token"
                  f"  +{(t - base) / batch * 1e6:7.1f} us/token vs none  ({t / base:.2f}x)")
    from tidal import LLM

    llm = LLM(model_dir, kv_cache_memory_bytes=64_000_000)
    print(f"engine ({'embedded model' if args.format == 'k3' else 'random Kimi Linear, K2 tokenizer'}, decode): "
          "ms per generated token")
    for batch in (1, 32):
        time_engine(llm, None, batch, args.tokens)  # warm at this batch size
        # none before and after the constrained runs: the machine's drift shows in their spread
        first = time_engine(llm, None, batch, args.tokens)
        timed = {name: time_engine(llm, spec, batch, args.tokens) for name, spec in list(cases.items())[1:]}
        last = time_engine(llm, None, batch, args.tokens)
        base = (first + last) / 2
        line = f"  batch {batch:2d}  none {first * 1e3:.2f} / {last * 1e3:.2f}"
        for name, t in timed.items():
            line += f"  {name} {t * 1e3:7.2f} ({(t - base) * 1e3:+.2f} ms/token, {t / base:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
