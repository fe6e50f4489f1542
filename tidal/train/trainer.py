"""The training loop: AdamW with warmup + cosine decay, MXFP4 QAT experts, aux-loss-free expert
balancing, checkpoints that carry the optimizer state so a schedule can span several runs.

Reproducible: the initial weights come from ``init_weights(seed)``, each step's batch is a pure
function of (seed, step) and nothing else is random, so a run resumed from a checkpoint takes the
same steps as one that never stopped.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tidal.config import ModelConfig
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.model.moe import Router
from tidal.train.data import Corpus, sample_batch
from tidal.train.trainable import load_plain_state_dict, make_trainable, plain_state_dict, qat_cached

STATE_FILE = "state.pt"
LOG_FILE = "train_log.jsonl"


@dataclass
class TrainConfig:
    steps: int = 850  # the whole schedule; a run may stop earlier (time_limit) and resume
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    chat_fraction: float = 0.3
    body_fraction: float = 0.0  # rows that start at a standalone function snippet
    copy_fraction: float = 0.0  # rows of stdlib spans each written twice (targets on the copies)
    seed: int = 0
    qat: bool = True
    bf16: bool = False  # bf16 autocast of the matmuls
    balance_rate: float = 2e-3  # router bias step per update (DeepSeek-V3 aux-loss-free balancing)
    save_every: int = 50
    log_every: int = 10
    eval_every: int = 100
    eval_windows: int = 8
    time_limit_s: float | None = None
    stop_at: int | None = None  # stop (and checkpoint) at this step: repeats a run a time limit cut short


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to cfg.lr, then cosine down to min_lr_ratio * lr at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def lm_loss(model: KimiForCausalLM, windows: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of windows [B, T+1], each a fresh sequence (varlen batch),
    over the target tokens ``mask`` [B, T+1] marks (all of them without a mask)."""
    B, n = windows.shape
    T = n - 1
    inputs = windows[:, :-1].reshape(-1)
    cache = SimpleCache(model.config, B, model.dtype, windows.device)
    batch = simple_batch(model.config, [T] * B, cache, [0] * B)
    logits = model.compute_logits(model(inputs, batch))
    targets = windows[:, 1:].reshape(-1)
    if mask is None:
        return F.cross_entropy(logits, targets)
    keep = mask[:, 1:].reshape(-1).to(logits.dtype)
    per_token = F.cross_entropy(logits, targets, reduction="none")
    return (per_token * keep).sum() / keep.sum().clamp(min=1)


class RouterLoad:
    """Counts the tokens each router sends to each expert (forward hooks), for bias balancing."""

    def __init__(self, model: KimiForCausalLM) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.counts = [torch.zeros(m.config.num_experts) for m in self.routers]
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: Router, args: Any, out: tuple[torch.Tensor, torch.Tensor]) -> None:
            self.counts[i] += torch.bincount(out[0].reshape(-1).cpu(), minlength=len(self.counts[i])).float()
        return hook

    @torch.no_grad()
    def balance(self, rate: float) -> float:
        """Nudge each under-loaded expert's bias up and each over-loaded one down; returns the
        worst max/mean load ratio seen since the last call, then resets the counts."""
        worst = 0.0
        for r, c in zip(self.routers, self.counts):
            if c.sum() == 0:
                continue
            worst = max(worst, float(c.max() / c.mean()))
            r.e_score_correction_bias += rate * torch.sign(c.mean() - c).to(r.e_score_correction_bias)
            c.zero_()
        return worst


def build_model(config: ModelConfig, seed: int, qat: bool) -> KimiForCausalLM:
    torch.manual_seed(seed)
    model = init_weights(KimiForCausalLM(config), seed=seed).to_dtype(torch.float32)
    return make_trainable(model, qat=qat)


def make_optimizer(model: KimiForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """Weight decay on matrices except embeddings; the router bias is not trained by gradient."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.requires_grad_(False)
            continue
        (decay if p.dim() >= 2 and "embed_tokens" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


@torch.no_grad()
def eval_loss(model: KimiForCausalLM, stream: torch.Tensor, seq_len: int, windows: int, bf16: bool = False) -> float:
    """Mean loss over the first ``windows`` non-overlapping windows of ``stream`` (fixed slice)."""
    n = seq_len + 1
    rows = [stream[i * seq_len : i * seq_len + n] for i in range(min(windows, (len(stream) - 1) // seq_len))]
    with qat_cached(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return float(lm_loss(model, torch.stack(rows).long()))


class Trainer:
    """Owns model, optimizer, step counter and the run directory."""

    def __init__(self, model_config: ModelConfig, corpus: Corpus, cfg: TrainConfig, out_dir: str | Path) -> None:
        self.config, self.corpus, self.cfg = model_config, corpus, cfg
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model = build_model(model_config, cfg.seed, cfg.qat)
        self.opt = make_optimizer(self.model, cfg)
        self.load = RouterLoad(self.model)
        self.step = 0
        self.tokens_seen = 0
        self.train_seconds = 0.0

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Path:
        path = self.out / STATE_FILE
        tmp = path.with_suffix(".tmp")
        torch.save({
            "step": self.step, "tokens_seen": self.tokens_seen, "train_seconds": self.train_seconds,
            "model": plain_state_dict(self.model), "optimizer": self.opt.state_dict(),
            "train_config": asdict(self.cfg), "model_config": self.config.to_dict(),
        }, tmp)
        os.replace(tmp, path)
        return path

    def resume(self) -> bool:
        """Load out_dir/state.pt if present (weights, optimizer, step); True when resumed."""
        path = self.out / STATE_FILE
        if not path.exists():
            return False
        state = torch.load(path, weights_only=False)
        load_plain_state_dict(self.model, state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.train_seconds = state.get("train_seconds", 0.0)
        return True

    def init_from(self, model_dir: str | Path) -> None:
        """Start from a trained checkpoint instead of random weights (fine-tuning): its weights,
        MXFP4 experts dequantised exactly, become the float32 master weights; QAT then continues."""
        from tidal.model.checkpoint import load_model

        loaded = load_model(model_dir, torch.float32)
        load_plain_state_dict(self.model, {k: v.float() for k, v in loaded.state_dict().items()})

    def inference_model(self) -> KimiForCausalLM:
        """A plain (unparametrised) copy with the master weights: the fp32 twin."""
        plain = KimiForCausalLM(self.config)
        plain.load_state_dict(plain_state_dict(self.model))
        return plain

    # ---- the loop ------------------------------------------------------------------------------
    def train_step(self) -> float:
        cfg = self.cfg
        windows, mask = sample_batch(self.corpus, cfg.seed, self.step, cfg.batch_size, cfg.seq_len,
                                     cfg.chat_fraction, cfg.body_fraction, cfg.copy_fraction)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(cfg, self.step)
        with qat_cached(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = lm_loss(self.model, windows, mask)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += windows[:, 1:].numel()
        return float(loss.detach())

    def run(self, log: Callable[[str], None] = print) -> dict[str, Any]:
        """Train until cfg.steps or the time limit; checkpoints every save_every steps and at the end."""
        cfg = self.cfg
        start = time.perf_counter()
        last_t, last_tokens, losses = start, self.tokens_seen, []
        record: dict[str, Any] = {}
        while self.step < (cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)):
            if cfg.time_limit_s is not None and time.perf_counter() - start >= cfg.time_limit_s:
                log(f"time limit reached at step {self.step}")
                break
            t0 = time.perf_counter()
            losses.append(self.train_step())
            imbalance = self.load.balance(cfg.balance_rate)
            self.train_seconds += time.perf_counter() - t0
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                now = time.perf_counter()
                record = {
                    "step": self.step, "loss": round(sum(losses) / len(losses), 4), "lr": lr_at(cfg, self.step - 1),
                    "tok_per_s": round((self.tokens_seen - last_tokens) / (now - last_t), 1),
                    "tokens": self.tokens_seen, "train_s": round(self.train_seconds, 1),
                    "max_expert_load": round(imbalance, 2),
                }
                if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                    record["heldout_loss"] = round(
                        eval_loss(self.model, self.corpus.heldout, cfg.seq_len, cfg.eval_windows, cfg.bf16), 4)
                log(json.dumps(record))
                with open(self.out / LOG_FILE, "a") as f:
                    f.write(json.dumps(record) + "\n")
                last_t, last_tokens, losses = time.perf_counter(), self.tokens_seen, []
            if self.step % cfg.save_every == 0:
                self.save()
        self.save()
        return record
