"""``tidal train --drafter dspark``: train a DSPARK drafter (tidal.spec.dspark) for a target on CPU.

1. **Cache** (once per target; ``cache.pt`` in --out): prompts from a mix like the embedded
   model's training data (stdlib code windows, bare function signatures as an editor sends them,
   K3 chat prompts cut after the user turn), each continued greedily by the target through the
   engine, then one target forward over prompt + continuation keeps the tap layers' hidden states
   of every position. The continuation is the target's own greedy output, so the labels of a block
   anchored inside it are exactly what greedy verify accepts.
2. **Train** the drafter on the cache: random anchors a in the continuation (a = the last prompt
   token .. the second-to-last token), context = the taps of the ``window`` positions before a,
   labels = tokens a+1 .. a+k; cross-entropy per slot weighted exp(-j / gamma) (DFlash's
   block-position decay: early slots decide the accept length). The target's embedding and LM
   head stay frozen. Seeded: the same command gives the same drafter.

    tidal train --drafter dspark --target tidal/assets/embedded --out /tmp/dspark \
        --export tidal/assets/embedded-dspark
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
import torch
import torch.nn.functional as F

from tidal.spec.dspark import DsparkConfig, DsparkModel, check_target, save_drafter, target_fingerprint

CACHE_FILE = "cache.pt"
STATE_FILE = "drafter_state.pt"


@dataclass
class Cache:
    """Sequences (prompt + the target's greedy continuation) and their tapped hidden states."""

    tokens: torch.Tensor  # [N] int64, all sequences concatenated
    starts: torch.Tensor  # [S] first index of each sequence
    lengths: torch.Tensor  # [S]
    prompt_lens: torch.Tensor  # [S]
    kinds: list[str]  # "code" / "signature" / "chat" per sequence
    taps: torch.Tensor  # [N, n_taps * d] bfloat16
    tap_layers: list[int]
    fingerprint: str

    def save(self, path: Path) -> None:
        torch.save(asdict(self), path)

    @classmethod
    def load(cls, path: Path) -> "Cache":
        return cls(**torch.load(path))


def training_prompts(tokenizer, seed: int, n_code: int, n_sig: int, n_chat: int, prompt_tokens: int
                     ) -> list[tuple[str, list[int]]]:
    """(kind, token ids) prompts from the embedded model's training mix (its training modules and
    conversation generators, never the held-out ones)."""
    from tidal.train.conversations import Conversation, training_conversations
    from tidal.train.data import doc_facts, function_snippets, load_sources

    rng = random.Random(f"{seed}/dspark-prompts")
    sources = load_sources()
    mods = sorted(sources.train.items())
    out: list[tuple[str, list[int]]] = []
    while len(out) < n_code:
        _, text = rng.choice(mods)
        lines = text.splitlines(keepends=True)
        if len(lines) < 40:
            continue
        i = rng.randrange(len(lines) - 30)
        ids = tokenizer.encode("".join(lines[i : i + 40]))[:prompt_tokens]
        if len(ids) >= 16:
            out.append(("code", ids))
    snippets = function_snippets(dict(mods), random.Random(f"{seed}/dspark-snippets"))
    for s in rng.sample(snippets, min(n_sig, len(snippets))):
        out.append(("signature", tokenizer.encode(s.header + "\n")))
    for c in training_conversations(rng, n_chat, doc_facts(sources.train)):
        first = Conversation(c.messages[:1], c.tools, c.effort, c.tool)
        out.append(("chat", first.render(add_generation_prompt=True).token_ids(tokenizer)[-4 * prompt_tokens:]))
    return out


def tap_forward(model, seqs: list[list[int]], tap_layers: list[int]) -> list[torch.Tensor]:
    """The target's hidden states after ``tap_layers`` at every position of each sequence (one
    batched prefill), concatenated per position: [len, n_taps * d] each."""
    from tidal.model.context import SimpleCache, simple_batch

    cache = SimpleCache(model.config, len(seqs), model.dtype, next(model.parameters()).device)
    fb = simple_batch(model.config, [len(s) for s in seqs], cache, [0] * len(seqs))
    fb.tap_layers = tuple(tap_layers)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    model(ids, fb)
    flat = torch.cat([fb.taps[t] for t in tap_layers], dim=-1)
    return list(flat.split([len(s) for s in seqs]))


def cache_from_sequences(target, seqs: list[list[int]], prompt_lens: list[int], kinds: list[str],
                         tap_layers: list[int]) -> Cache:
    """The cache of sequences (prompt + the target's greedy continuation) of ``target``."""
    taps: list[torch.Tensor] = []
    with torch.inference_mode():
        for i in range(0, len(seqs), 16):
            taps += [t.to(torch.bfloat16) for t in tap_forward(target, seqs[i : i + 16], tap_layers)]
    lengths = torch.tensor([len(s) for s in seqs])
    return Cache(tokens=torch.tensor([t for s in seqs for t in s]), starts=torch.cumsum(lengths, 0) - lengths,
                 lengths=lengths, prompt_lens=torch.tensor(prompt_lens), kinds=list(kinds), taps=torch.cat(taps),
                 tap_layers=list(tap_layers), fingerprint=target_fingerprint(target))


def build_cache(target_dir: str, tap_layers: list[int], seed: int, n_code: int, n_sig: int, n_chat: int,
                prompt_tokens: int, gen_tokens: int, log) -> Cache:
    from tidal import LLM, SamplingParams

    llm = LLM(target_dir, enable_prefix_caching=False)
    prompts = training_prompts(llm.tokenizer, seed, n_code, n_sig, n_chat, prompt_tokens)
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=gen_tokens)
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids in prompts], params)
    seqs = [ids + list(o.outputs[0].token_ids) for (_, ids), o in zip(prompts, outs)]
    log(f"generated {sum(len(o.outputs[0].token_ids) for o in outs)} greedy tokens for {len(prompts)} prompts "
        f"in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    cache = cache_from_sequences(llm.engine.model, seqs, [len(ids) for _, ids in prompts], [k for k, _ in prompts],
                                 tap_layers)
    log(f"tapped layers {tap_layers} over {len(cache.tokens)} positions in {time.perf_counter() - t0:.0f} s")
    return cache


def anchors_of(cache: Cache, block: int) -> torch.Tensor:
    """Flat indexes of every trainable anchor: the last prompt token .. the second-to-last token
    of each sequence (at least one label after it)."""
    out = []
    for s, n, p in zip(cache.starts.tolist(), cache.lengths.tolist(), cache.prompt_lens.tolist()):
        out.append(torch.arange(s + p - 1, s + n - 1))
    return torch.cat(out)


def block_batch(cache: Cache, anchors: torch.Tensor, window: int, block: int) -> dict[str, torch.Tensor]:
    """Training tensors for flat anchor indexes (context taps, labels, their masks)."""
    seq = torch.searchsorted(cache.starts, anchors, right=True) - 1
    start, end = cache.starts[seq], cache.starts[seq] + cache.lengths[seq]
    ctx_idx = anchors[:, None] - window + torch.arange(window)  # positions a-W .. a-1
    ctx_valid = ctx_idx >= start[:, None]
    ctx = cache.taps[ctx_idx.clamp(min=0)].float()
    lab_idx = anchors[:, None] + 1 + torch.arange(block)
    lab_valid = lab_idx < end[:, None]
    labels = cache.tokens[lab_idx.clamp(max=len(cache.tokens) - 1)]
    prev = torch.cat([cache.tokens[anchors][:, None], labels[:, :-1]], dim=1)
    return {"ctx": ctx, "ctx_pos": ctx_idx - start[:, None], "ctx_valid": ctx_valid,
            "anchor": cache.tokens[anchors], "anchor_pos": anchors - start, "labels": labels,
            "lab_valid": lab_valid, "prev": prev}


def drafter_loss(model: DsparkModel, target, batch: dict[str, torch.Tensor], block: int, gamma: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(decayed cross-entropy, per-slot top-1 accuracy) of one batch."""
    embed = target.model.embed_tokens.weight.detach().float()
    head = target.lm_head.weight.detach().float()
    ctx = model.context(batch["ctx"])
    h = model(ctx, batch["ctx_pos"], batch["ctx_valid"], embed[batch["anchor"]], batch["anchor_pos"], block)
    logits = h @ head.T + model.markov_bias(batch["prev"])
    ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view_as(batch["labels"])
    w = torch.exp(-torch.arange(block, dtype=torch.float32) / gamma)[None] * batch["lab_valid"]
    loss = (ce * w).sum() / w.sum()
    right = (logits.argmax(-1) == batch["labels"]) & batch["lab_valid"]
    acc = right.sum(0).float() / batch["lab_valid"].sum(0).clamp(min=1)
    return loss, acc


def accept_length_estimate(model: DsparkModel, target, cache: Cache, anchors: torch.Tensor, block: int,
                           window: int) -> float:
    """Mean committed tokens per verified block (drafts accepted while every earlier one was right,
    + 1) on teacher-forced anchors, with the drafts chosen as the drafter chooses them (Markov head
    fed its own previous argmax)."""
    embed = target.model.embed_tokens.weight.detach().float()
    head = target.lm_head.weight.detach().float()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(anchors), 256):
            b = block_batch(cache, anchors[i : i + 256], window, block)
            h = model(model.context(b["ctx"]), b["ctx_pos"], b["ctx_valid"], embed[b["anchor"]], b["anchor_pos"],
                      block)
            base = h @ head.T
            prev = b["anchor"]
            ok = torch.ones(len(prev), dtype=torch.bool)
            n = torch.ones(len(prev))
            for j in range(block):
                tok = (base[:, j] + model.markov_bias(prev)).argmax(-1)
                ok = ok & (tok == b["labels"][:, j]) & b["lab_valid"][:, j]
                n += ok.float()
                prev = tok
            total += float(n.sum())
            count += len(n)
    return total / max(1, count)


def train_drafter(model: DsparkModel, target, cache: Cache, anchors: torch.Tensor, steps: int, batch_size: int,
                  lr: float, gamma: float, seed: int, log=print, log_every: int = 50,
                  time_limit: float | None = None) -> int:
    """AdamW with warm-up and cosine decay over ``steps`` batches of random ``anchors`` (seeded);
    returns the last step run (``time_limit`` minutes may stop it early)."""
    cfg = model.cfg
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    step = 0
    for step in range(1, steps + 1):
        rate = lr * min(1.0, step / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = rate
        pick = anchors[torch.randint(len(anchors), (batch_size,), generator=g)]
        loss, acc = drafter_loss(model, target, block_batch(cache, pick, cfg.window, cfg.block_size),
                                 cfg.block_size, gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == 1:
            log(json.dumps({"step": step, "loss": round(loss.item(), 4), "acc": [round(float(x), 3) for x in acc],
                            "lr": round(rate, 6), "s": round(time.perf_counter() - t0, 1)}))
        if time_limit is not None and time.perf_counter() - t0 > time_limit * 60:
            log(f"time limit: stopped at step {step}")
            break
    return step


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal train --drafter dspark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", choices=["dspark"], required=True)
    p.add_argument("--target", default=None, help="the target checkpoint directory (default: the embedded model)")
    p.add_argument("--out", default="/tmp/tidal-dspark", help="run directory (the cache and the training state)")
    p.add_argument("--export", default=None, help="write the drafter (dspark_config.json + model.safetensors) here")
    p.add_argument("--tap-layers", type=int, nargs="+", default=None,
                   help="target layers (0-based) to tap (default: every other layer, ending at the last)")
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--markov-rank", type=int, default=32)
    p.add_argument("--code-prompts", type=int, default=160)
    p.add_argument("--signature-prompts", type=int, default=64)
    p.add_argument("--chat-prompts", type=int, default=160)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--gen-tokens", type=int, default=96, help="greedy tokens the target adds to each prompt")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--gamma", type=float, default=4.0, help="loss weight of block slot j: exp(-j / gamma)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--time-limit", type=float, default=None, help="stop training after this many minutes")
    p.add_argument("--log-every", type=int, default=50)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from tidal.model.checkpoint import load_model, read_config

    target_dir = args.target
    if target_dir is None:
        from tidal.llm import _default_model_dir

        target_dir = str(_default_model_dir())
    tcfg = read_config(Path(target_dir))
    L = tcfg.num_hidden_layers
    taps = args.tap_layers or list(range(L - 1, -1, -2))[::-1]

    def log(msg: str) -> None:
        print(msg, flush=True)

    cache_path = out / CACHE_FILE
    target = load_model(target_dir, torch.float32).eval()
    fp = target_fingerprint(target)
    cache = Cache.load(cache_path) if cache_path.exists() else None
    if cache is not None and (cache.fingerprint != fp or cache.tap_layers != taps):
        log(f"{cache_path} is for another target or tap layers: rebuilding it")
        cache = None
    if cache is None:
        cache = build_cache(target_dir, taps, args.seed, args.code_prompts, args.signature_prompts,
                            args.chat_prompts, args.prompt_tokens, args.gen_tokens, log)
        cache.save(cache_path)
    cfg = DsparkConfig(vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, target_num_layers=L,
                       tap_layers=taps, block_size=args.block_size, num_layers=args.num_layers,
                       num_heads=max(1, tcfg.hidden_size // 64), head_dim=64,
                       intermediate_size=args.intermediate_size, markov_rank=args.markov_rank, window=args.window,
                       rms_norm_eps=tcfg.rms_norm_eps, target_fingerprint=fp)
    check_target(cfg, tcfg)
    model = DsparkModel(cfg).init_weights(args.seed)
    log(f"drafter: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, taps {taps}, block "
        f"{args.block_size}, window {args.window}")
    anchors = anchors_of(cache, args.block_size)
    # Held out for the accept-length estimate: every 20th sequence's anchors.
    seq_of = torch.searchsorted(cache.starts, anchors, right=True) - 1
    held = anchors[seq_of % 20 == 19]
    train = anchors[seq_of % 20 != 19]
    log(f"cache: {len(cache.lengths)} sequences, {len(train)} training anchors, {len(held)} held out")
    step = train_drafter(model, target, cache, train, args.steps, args.batch_size, args.lr, args.gamma, args.seed,
                         log, args.log_every, args.time_limit)
    tau = accept_length_estimate(model, target, cache, held, args.block_size, args.window)
    cfg.recipe = {"command": "tidal train " + " ".join(sys.argv[2:] if argv is None else argv), "steps": step,
                  "sequences": len(cache.lengths), "heldout_accept_length": round(tau, 3)}
    log(f"held-out accept length (teacher-forced, block {args.block_size}): {tau:.3f}")
    torch.save(model.state_dict(), out / STATE_FILE)
    if args.export:
        path = save_drafter(model, args.export)
        log(f"exported the drafter to {path}")
    return 0


def dispatch(argv: list[str]) -> int | None:
    """``tidal train`` with ``--drafter``: this module's main (None otherwise)."""
    if any(a == "--drafter" or a.startswith("--drafter=") for a in argv):
        return main(argv)
    return None
