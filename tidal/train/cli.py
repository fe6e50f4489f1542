"""``tidal train``: train a small K3-architecture model on CPU from offline data.

A run directory (--out) holds everything: the tokenizer, the tokenised corpus, ``state.pt``
(weights + optimizer + step) and ``train_log.jsonl``. Running the same command again resumes from
``state.pt``; --time-limit stops a run early (after a checkpoint), so a long schedule can be spread
over several runs, and --stop-at N repeats a run that a time limit cut at step N. --init starts a
fine-tune from a checkpoint directory (its tokenizer, its weights with MXFP4 experts dequantised
into the float32 master weights; QAT continues). Conversation rows carry loss only on the
assistant's tokens. --export writes the fp32 checkpoint (dense experts) with its tokenizer; then
``tidal quantize`` makes the MXFP4 one. The README ("The embedded model") gives the recipe of the
shipped model. ``tidal train --drafter dspark --target DIR`` trains a DSPARK drafter for a target
instead (tidal.spec.dspark_train).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tidal.config import ModelConfig
from tidal.train.trainer import TrainConfig, Trainer

PREPARE_FILE = "prepare.json"
CORPUS_FILE = "corpus.pt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SIZES = ("embedded", "tiny")


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="tidal train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/tidal-train", help="run directory (resumed when it holds state.pt)")
    p.add_argument("--size", default="embedded", choices=SIZES, help="model size: the embedded model, or a tiny test model")
    p.add_argument("--steps", type=int, default=d.steps, help="length of the whole schedule (steps)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--chat-fraction", type=float, default=d.chat_fraction, help="share of rows that are conversations")
    p.add_argument("--body-fraction", type=float, default=d.body_fraction,
                   help="share of rows that start at a standalone function (signature, then its body)")
    p.add_argument("--copy-fraction", type=float, default=d.copy_fraction,
                   help="share of rows that repeat stdlib spans (loss on the repeats): in-context copying")
    p.add_argument("--init", default=None,
                   help="fine-tune: start from this checkpoint directory (its tokenizer too) instead of random weights")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (measured slower on CPU for this model)")
    p.add_argument("--no-qat", action="store_true", help="train experts without MXFP4 fake quantisation")
    p.add_argument("--time-limit", type=float, default=None, help="stop (and checkpoint) after this many minutes")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop (and checkpoint) at this step of the schedule: repeats a run that a time limit cut short")
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out loss every N steps (0: never)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--conversations", type=int, default=6000, help="synthetic conversations to generate")
    p.add_argument("--max-modules", type=int, default=None, help="use only the first N training modules (tests)")
    p.add_argument("--export", default=None, help="write the fp32 checkpoint + tokenizer here when done")
    p.add_argument("--blend-with", default=None,
                   help="--export a weight-space blend of the trained weights with this checkpoint (e.g. --init's)")
    p.add_argument("--blend", type=float, default=0.5, help="with --blend-with: the trained weights' share")
    p.add_argument("--fresh", action="store_true", help="ignore an existing state.pt")
    return p


def model_config(size: str, tokenizer: Any) -> ModelConfig:
    """The architecture for ``size`` over ``tokenizer``'s vocabulary and K3 special ids."""
    from tidal.embedded import embedded_config_dict
    from tidal.presets import tiny_k3_dict

    vocab = (tokenizer.vocab_size + 63) // 64 * 64
    if size == "embedded":
        d = embedded_config_dict(vocab)
    else:
        d = tiny_k3_dict(hidden_size=64, num_layers=4, vocab_size=vocab, attn_res_block_size=2, num_experts=8)
    ids = {t: tokenizer.token_id(t) for t in ("[BOS]", "[EOS]", "<|end_of_msg|>", "[PAD]")}
    eos = [ids["<|end_of_msg|>"], ids["[EOS]"]]
    d.update(bos_token_id=ids["[BOS]"], eos_token_id=eos, pad_token_id=ids["[PAD]"])
    d["text_config"].update(eos_token_id=eos, bos_token_id=ids["[BOS]"], pad_token_id=ids["[PAD]"])
    return ModelConfig.from_dict(d)


def prepare(out: Path, args: argparse.Namespace, log: Any) -> tuple[Any, Any]:
    """Tokenizer and corpus of the run directory, built once (and checked on resume)."""
    from tidal.tokenizer import load_tokenizer
    from tidal.train.data import Corpus, build_corpus, conversation_prompts, function_snippets, load_sources
    from tidal.train.tokenizer_train import save_tokenizer, train_tokenizer

    recipe = {"seed": args.seed, "vocab_size": args.vocab_size, "conversations": args.conversations,
              "max_modules": args.max_modules, "python": sys.version.split()[0]}
    if args.init:
        recipe["init"] = str(Path(args.init).resolve())
    marker = out / PREPARE_FILE
    if marker.exists() and (out / CORPUS_FILE).exists():
        saved = json.loads(marker.read_text())
        if saved != recipe:
            raise ValueError(f"{out} was prepared with {saved}, this run asks for {recipe}; use another --out")
        return load_tokenizer(out), Corpus.load(out / CORPUS_FILE)
    t0 = time.perf_counter()
    sources = load_sources()
    if args.max_modules is not None:
        sources.train = dict(sorted(sources.train.items())[: args.max_modules])
    chats = conversation_prompts(args.seed, args.conversations, sources)
    if args.init:  # a fine-tune keeps its checkpoint's tokenizer
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(args.init) / name, out / name)
    else:
        save_tokenizer(train_tokenizer([*sources.train.values(), *(c.text for c in chats)], args.vocab_size), out)
    tokenizer = load_tokenizer(out)
    snippets = function_snippets(sources.train, random.Random(f"{args.seed}/snippets"))
    corpus = build_corpus(tokenizer, sources, chats, tokenizer.token_id("[EOS]"), snippets, args.seed)
    corpus.save(out / CORPUS_FILE)
    marker.write_text(json.dumps(recipe))
    log(f"prepared {len(sources.train)} training modules ({len(corpus.code)} tokens), {len(chats)} conversations "
        f"({len(corpus.chat)} tokens, {int(corpus.chat_mask.sum())} of them the assistant's), "
        f"{len(snippets)} function snippets ({len(corpus.body)} tokens), "
        f"{len(sources.heldout)} held-out modules ({len(corpus.heldout)} tokens) in {time.perf_counter() - t0:.1f} s")
    return tokenizer, corpus


def blend_into(model: torch.nn.Module, other_dir: str | Path, weight: float) -> None:
    """Weight-space blend of a fine-tune with its starting checkpoint (a "model soup"):
    ``weight * model + (1 - weight) * other`` for every floating tensor, in place. Fine-tuning
    from ``other`` keeps both in one basin, so the blend keeps most of what each does well."""
    from tidal.model.checkpoint import load_model

    theirs = load_model(other_dir, torch.float32).state_dict()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.mul_(weight).add_(theirs[name].float(), alpha=1 - weight)


def export(trainer: Trainer, run_dir: Path, dst: str | Path, blend_with: str | None = None, blend: float = 1.0) -> Path:
    """The fp32 twin: master weights (blended with ``blend_with`` when given), dense experts,
    with the run's tokenizer."""
    from tidal.model.checkpoint import save_model

    model = trainer.inference_model()
    if blend_with is not None:
        blend_into(model, blend_with, blend)
    out = save_model(model, dst, expert_format="dense", dtype=torch.float32)
    for name in TOKENIZER_FILES:
        shutil.copyfile(run_dir / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    from tidal.spec.dspark_train import dispatch

    drafter = dispatch(sys.argv[1:] if argv is None else argv)  # `tidal train --drafter dspark ...`
    if drafter is not None:
        return drafter
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        tokenizer, corpus = prepare(out, args, log)
    except ValueError as e:
        print(f"tidal train: {e}", file=sys.stderr)
        return 2
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup,
        seed=args.seed, chat_fraction=args.chat_fraction, body_fraction=args.body_fraction,
        copy_fraction=args.copy_fraction, qat=not args.no_qat, bf16=args.bf16,
        save_every=args.save_every, log_every=args.log_every, eval_every=args.eval_every,
        time_limit_s=args.time_limit * 60 if args.time_limit is not None else None, stop_at=args.stop_at,
    )
    config = model_config(args.size, tokenizer)
    trainer = Trainer(config, corpus, cfg, out)
    if args.fresh:
        (out / "state.pt").unlink(missing_ok=True)
    if not args.fresh and trainer.resume():
        log(f"resumed at step {trainer.step} ({trainer.tokens_seen} tokens)")
    elif args.init:
        trainer.init_from(args.init)
        log(f"initialised from {args.init}")
    n_params = sum(p.numel() for p in trainer.model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters; config: {json.dumps(asdict(cfg))}")
    trainer.run(log)
    log(f"stopped at step {trainer.step}/{cfg.steps}; checkpoint {out / 'state.pt'}")
    if args.export:
        log(f"exported fp32 checkpoint to {export(trainer, out, args.export, args.blend_with, args.blend)}")
    return 0
