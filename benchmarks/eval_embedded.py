"""The embedded model's measured figures (README "Embedded model").

    python benchmarks/eval_embedded.py [--model DIR] [--twin /tmp/tidal-fp32] [--run-dir /tmp/tidal-train]

- held-out loss / perplexity on the held-out stdlib modules vs a unigram baseline fitted on the
  training tokens (from --run-dir's corpus.pt, else rebuilt with the default recipe);
- share of greedy completions of --headers held-out function headers that ``ast`` parses;
- share of --tool-prompts held-out tool-use prompts whose reply parses (server K3 parser) into a
  valid call of the right tool;
- with --twin (the fp32 checkpoint ``tidal train --export`` wrote): its held-out loss and the
  MXFP4 - fp32 gap.
--model defaults to the shipped embedded checkpoint, loaded in float32 as ``tidal generate`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from tidal.model.checkpoint import load_model
from tidal.tokenizer import load_tokenizer
from tidal.train.data import Corpus, build_corpus, conversation_prompts, load_sources
from tidal.train.evaluate import function_headers, header_rate, stream_loss, tool_rates, unigram_loss


def corpus_for(tokenizer, run_dir: str | None) -> Corpus:
    """The run's tokenised corpus, or the default recipe's (seed 0, 6000 conversations) rebuilt."""
    if run_dir and (Path(run_dir) / "corpus.pt").exists():
        return Corpus.load(Path(run_dir) / "corpus.pt")
    sources = load_sources()
    return build_corpus(tokenizer, sources, conversation_prompts(0, 6000, sources), tokenizer.token_id("[EOS]"))


def main() -> None:
    from tidal.embedded import embedded_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(embedded_model_dir()))
    ap.add_argument("--twin", default=None, help="fp32 twin checkpoint for the MXFP4 loss gap")
    ap.add_argument("--run-dir", default=None, help="training run directory holding corpus.pt")
    ap.add_argument("--headers", type=int, default=100)
    ap.add_argument("--tool-prompts", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", type=int, default=3, help="print this many sample completions of each kind")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    tok = load_tokenizer(args.model)
    corpus = corpus_for(tok, args.run_dir)
    model = load_model(args.model, torch.float32)
    res: dict[str, float | int | str] = {"model": args.model}
    loss, n = stream_loss(model, corpus.heldout, args.seq_len)
    uni = unigram_loss(corpus.token_counts(model.config.vocab_size), corpus.heldout)
    res.update(heldout_tokens=n, heldout_loss=loss, heldout_ppl=math.exp(loss), unigram_loss=uni, unigram_ppl=math.exp(uni))
    print(f"held-out loss {loss:.4f} nats/token (ppl {math.exp(loss):.1f}) over {n} tokens; "
          f"unigram baseline {uni:.4f} (ppl {math.exp(uni):.1f})")
    if args.twin:
        twin = load_model(args.twin, torch.float32)
        twin_loss, _ = stream_loss(twin, corpus.heldout, args.seq_len)
        res.update(twin=args.twin, twin_loss=twin_loss, mxfp4_gap=loss - twin_loss)
        print(f"fp32 twin held-out loss {twin_loss:.4f}; MXFP4 - fp32 gap {loss - twin_loss:+.4f} nats/token")

    headers = function_headers(load_sources().heldout, args.headers)
    rate, texts = header_rate(model, tok, headers)
    res.update(headers=len(headers), header_parse_rate=rate)
    print(f"function headers: {rate:.1%} of {len(headers)} greedy completions parse with ast")
    for h, t in list(zip(headers, texts))[: args.show]:
        print(f"--- {h}{t}")

    ok, named, replies = tool_rates(model, tok, args.tool_prompts)
    res.update(tool_prompts=args.tool_prompts, tool_call_rate=ok, tool_name_rate=named)
    print(f"tool use: {ok:.1%} of {args.tool_prompts} held-out prompts give a valid call of the right tool "
          f"({named:.1%} name the right tool)")
    for r in replies[: args.show]:
        print(f"--- {r}")
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"({res['seconds']} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
