"""The embedded model's measured figures (README "The embedded model"), for one or more models on
the same held-out prompts and text.

    python benchmarks/eval_embedded.py [--model DIR] [--baseline OLD_DIR] [--twin /tmp/tidal-fp32] [--run-dir RUN]

Per model (through the engine, as the server runs it: float32 trunk, MXFP4 experts packed):

- held-out loss on the 12 held-out stdlib modules, in nats per token and nats per byte (UTF-8
  bytes of the modules' text: comparable across tokenizers); with --run-dir, the unigram baseline
  fitted on that run's training tokens;
- bare signatures: share of greedy completions of the 40 held-out signatures
  (tidal.train.code_tasks.HELDOUT_SIGNATURES, no docstring) that parse with ``ast`` and hold a
  statement besides ``pass``: prompt without the trailing newline, with it, and with it
  token-healed (the server's default for /v1/completions);
- tool choice: share of the 40 held-out two-/three-tool prompts (tools and values training never
  declares, default effort ``low``) answered with a call of the right tool whose arguments are a
  JSON object matching the declared schema, as the model writes it, as the server returns it by
  default (held to the chat reply grammar, the tool name picked by its token mask), and as it
  returns it under ``--tool-name-choice whole`` (each declared name scored whole:
  tidal.engine.whole_choice); and the older metric, 50 prompts over the nine named tools with
  held-out values (effort ``max``);
- replies to chats with no tools declared (a terse system message + "Count to three.", and five
  short requests; sampled, thinking off) that call a tool: as the model writes them, and as the
  server returns them (held to the K3 skeleton: no tools element);
- the README's chat example ("Write a Python function that reverses a list.") at the model's
  default effort: a closed fenced code block that parses within 64 tokens;
- the older header metric: greedy completions of 100 held-out stdlib function headers that parse;
- with --twin (the fp32 checkpoint ``tidal train --export`` wrote): the MXFP4 - fp32 loss gap;
- in-context copying: loss on held-out spans written a second time, against their first writing
  (choosing a declared tool and copying its arguments needs it).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from tidal.model.checkpoint import load_model
from tidal.serve.cli import model_default_effort
from tidal.tokenizer import load_tokenizer
from tidal.train.code_tasks import HELDOUT_SIGNATURES
from tidal.train.data import Corpus, load_sources
from tidal.train.evaluate import (
    copy_loss, function_headers, header_rate, pool_tool_rates, readme_chat, signature_rates, stream_loss, tool_rates,
    undeclared_call_counts, unigram_loss,
)


def heldout_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text) + [tokenizer.token_id("[EOS]")]
    return torch.tensor(ids, dtype=torch.int32)


def evaluate(model_dir: str, args: argparse.Namespace, show: int) -> dict:
    t0 = time.perf_counter()
    tok = load_tokenizer(model_dir)
    heldout = load_sources().heldout
    texts = [t for _, t in sorted(heldout.items())]
    stream = heldout_stream(tok, texts)
    n_bytes = sum(len(t.encode()) for t in texts)
    model = load_model(model_dir, torch.float32)
    res: dict = {"model": model_dir}
    loss, n = stream_loss(model, stream, args.seq_len)
    res.update(heldout_tokens=n, heldout_bytes=n_bytes, heldout_loss=loss, heldout_nats_per_byte=loss * n / n_bytes)
    print(f"[{model_dir}] held-out loss {loss:.4f} nats/token, {loss * n / n_bytes:.4f} nats/byte "
          f"({n} tokens, {n_bytes} bytes)")
    if args.run_dir:
        corpus = Corpus.load(Path(args.run_dir) / "corpus.pt")
        uni = unigram_loss(corpus.token_counts(model.config.vocab_size), stream)
        res.update(unigram_loss=uni)
        print(f"  unigram baseline {uni:.4f} nats/token")
    if args.twin:
        twin_loss, _ = stream_loss(load_model(args.twin, torch.float32), stream, args.seq_len)
        res.update(twin=args.twin, twin_loss=twin_loss, mxfp4_gap=loss - twin_loss)
        print(f"  fp32 twin {twin_loss:.4f}; MXFP4 - fp32 gap {loss - twin_loss:+.4f} nats/token")

    if args.targets_only:  # the four targets only: skip the copy loss and the older metrics
        del model
        return targets(model_dir, args, show, res, t0)
    copied, first = copy_loss(model, stream)
    res.update(copy_loss=copied, copy_first_loss=first)
    print(f"  in-context copying: {copied:.3f} nats/token on held-out spans written a second time, {first:.3f} on the first writing")

    headers = function_headers(heldout, 100)
    rate, _ = header_rate(model, tok, headers)
    res.update(header_parse_rate=rate)
    print(f"  held-out stdlib headers (older metric): {rate:.1%} of {len(headers)} parse")
    del model
    return targets(model_dir, args, show, res, t0)


def targets(model_dir: str, args: argparse.Namespace, show: int, res: dict, t0: float) -> dict:
    """The engine-run figures: signatures, tool prompts, the README chat example (and, unless
    --targets-only, the nine named tools)."""
    from tidal import LLM

    tok = load_tokenizer(model_dir)
    llm = LLM(model_dir)
    sig = signature_rates(llm, HELDOUT_SIGNATURES)
    res.update({f"signature_{k}": v for k, v in sig.items() if not k.endswith("_texts")})
    print(f"  bare signatures ({len(HELDOUT_SIGNATURES)}): {sig['no_newline']:.1%} without newline, "
          f"{sig['newline']:.1%} with, {sig['newline_healed']:.1%} with + token healing")
    for text in sig["newline_texts"][:show]:
        print(f"  --- {text!r}")
    ok, named, replies = pool_tool_rates(llm, 40)
    res.update(pool_tool_call_rate=ok, pool_tool_name_rate=named)
    print(f"  held-out 2/3-tool prompts (40): {ok:.1%} right tool with schema-valid arguments ({named:.1%} right tool)")
    for r in replies[:show]:
        print(f"  --- {r!r}")
    ok_s, named_s, replies_s = pool_tool_rates(llm, 40, served=True)
    res.update(pool_served_call_rate=ok_s, pool_served_name_rate=named_s)
    print(f"  as the server returns them (/v1/chat/completions, tool_choice auto: the reply grammar, the tool name "
          f"picked by its token mask): {ok_s:.1%} right tool with schema-valid arguments ({named_s:.1%} right tool)")
    for r in replies_s[:show]:
        print(f"  --- {r!r}")
    ok_w, named_w, _ = pool_tool_rates(llm, 40, served=True, whole_names=True)
    res.update(pool_whole_call_rate=ok_w, pool_whole_name_rate=named_w)
    print(f"  the same under --tool-name-choice whole (each declared name scored whole): "
          f"{ok_w:.1%} right tool with schema-valid arguments ({named_w:.1%} right tool)")
    raw_calls, served_calls = undeclared_call_counts(llm), undeclared_call_counts(llm, served=True)
    res.update(no_tools_raw_calls=raw_calls, no_tools_served_calls=served_calls)
    print("  replies with no tools declared that call one (sampled, thinking off), as the model writes them / as "
          "the server returns them: " + "; ".join(f"{req!r} {a}/{n} / {b}/{n}"
                                                 for (req, a, n), (_, b, _) in zip(raw_calls, served_calls)))
    if not args.targets_only:
        ok9, named9, _ = tool_rates(load_model(model_dir, torch.float32), tok, 50)
        res.update(tool_call_rate=ok9, tool_name_rate=named9)
        print(f"  nine named tools, held-out values (older metric, 50): {ok9:.1%} valid right-tool calls "
              f"({named9:.1%} right tool)")
    effort = model_default_effort(Path(model_dir))
    good, reply = readme_chat(llm, effort)
    res.update(readme_chat_ok=good, readme_chat_effort=effort, readme_chat_reply=reply)
    print(f"  README chat example at effort {effort}: {'parses' if good else 'NO parsing code block'} within 64 tokens: {reply!r}")
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def main() -> None:
    from tidal.embedded import embedded_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(embedded_model_dir()))
    ap.add_argument("--baseline", default=None, help="another checkpoint measured the same way (e.g. the previous model)")
    ap.add_argument("--twin", default=None, help="fp32 twin of --model for the MXFP4 loss gap")
    ap.add_argument("--run-dir", default=None, help="training run directory (corpus.pt) for the unigram baseline")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", type=int, default=3, help="print this many sample completions of each kind")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--targets-only", action="store_true",
                    help="only the issue's targets (loss and gap, signatures, tool prompts, chat example): quicker")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    random.seed(0)
    results = [evaluate(args.model, args, args.show)]
    if args.baseline:
        base_args = argparse.Namespace(**{**vars(args), "twin": None})
        results.append(evaluate(args.baseline, base_args, 0))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
