"""DSPARK drafter: a DFlash-style block drafter on the target's hidden states (spec/speculative.md §1).

One forward pass drafts a block of k tokens. The block's input is the anchor (the last committed
token, which the target has not run yet) followed by k-1 learned MASK vectors, at positions
n-1 .. n+k-2; slot j predicts the token at position n+j ("slot k predicts anchor+k+1": slot 0 is
the next token, never slot 1 — reading slot j+1 for draft j is the off-by-one that drops the
accept length to about 1). The drafter's context is "KV injection": the target's hidden states
after ``tap_layers`` at the committed positions 0 .. n-2 (at most the last ``window`` of them),
concatenated, ``fc`` + RMSNorm, and fed as extra keys/values to every draft layer. Inside the
block attention is causal (slot j sees slots <= j), so any block size up to the trained one drafts
the same first tokens. Embedding and LM head are the target's own (not stored here). A Markov head
(DSpark's sequential head) adds a rank-r bias W2(W1[x_{j-1}]) from the previous token to slot j's
logits, and the drafts are its argmax left to right (q one-hot: rejection sampling stays exact).

State across rollback: the drafter only ever sees hidden states of committed tokens (the
speculation loop feeds it the accepted prefix of a verified chain, never a rejected position), so
a rejection needs no undo; a position seen twice (a preempted request recomputed) is overwritten.

Files: ``dspark_config.json`` (:class:`DsparkConfig`) and ``model.safetensors`` (the drafter's own
weights); ``target_fingerprint`` identifies the target it was trained on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tidal.model.layers import rms_norm
from tidal.spec.drafter import Draft

logger = logging.getLogger(__name__)

CONFIG_FILE = "dspark_config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class DsparkConfig:
    vocab_size: int
    hidden_size: int  # the target's hidden size (its embedding and LM head are shared)
    target_num_layers: int
    tap_layers: list[int]  # target layers (0-based) whose output hidden states are the context
    block_size: int = 7  # the largest block this drafter was trained for
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 512
    markov_rank: int = 32  # 0: no Markov head
    window: int = 64  # committed positions of context attended
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    target_fingerprint: str = ""
    recipe: dict = field(default_factory=dict)  # how it was trained (informational)

    @classmethod
    def read(cls, path: str | Path) -> "DsparkConfig":
        root = Path(path)
        f = root / CONFIG_FILE
        if not f.is_file():
            raise ValueError(f"speculative_draft_model_path {str(root)!r} holds no {CONFIG_FILE}: not a DSPARK "
                             f"drafter (train one with `tidal train --drafter dspark`)")
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not valid JSON ({e})") from None
        names = {x.name for x in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{f}: unknown DSPARK config keys {unknown}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"{f}: {e}") from None

    def write(self, path: str | Path) -> None:
        (Path(path) / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")


def target_fingerprint(target: nn.Module) -> str:
    """Identifies a target's weights (its embedding rounded to bf16, whatever dtype it was loaded
    in): a drafter trained on another model loads, but drafts badly."""
    w = target.model.embed_tokens.weight.detach().to("cpu", torch.bfloat16).contiguous()
    return hashlib.sha256(w.view(torch.int16).numpy().tobytes()).hexdigest()[:16]


def check_target(cfg: DsparkConfig, target_config, where: str = "the DSPARK drafter") -> None:
    """A clear error when the drafter cannot run on this target (vocabulary, width, tap layers)."""
    if cfg.vocab_size != target_config.vocab_size:
        raise ValueError(f"{where}: vocab_size {cfg.vocab_size} is not the target's {target_config.vocab_size} "
                         f"(DSPARK needs the target's tokenizer)")
    if cfg.hidden_size != target_config.hidden_size:
        raise ValueError(f"{where}: hidden_size {cfg.hidden_size} is not the target's {target_config.hidden_size}")
    if cfg.target_num_layers != target_config.num_hidden_layers:
        raise ValueError(f"{where}: trained on a target of {cfg.target_num_layers} layers, this one has "
                         f"{target_config.num_hidden_layers}")
    if not cfg.tap_layers or any(not 0 <= t < target_config.num_hidden_layers for t in cfg.tap_layers) \
            or len(set(cfg.tap_layers)) != len(cfg.tap_layers):
        raise ValueError(f"{where}: tap_layers {cfg.tap_layers} must be distinct target layers in "
                         f"0..{target_config.num_hidden_layers - 1}")
    if cfg.block_size < 1 or cfg.window < cfg.block_size + 1:
        raise ValueError(f"{where}: needs block_size >= 1 and window >= block_size + 1, got block_size "
                         f"{cfg.block_size}, window {cfg.window}")


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half) of x [..., T, H, D] at integer positions pos [..., T]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = pos.to(torch.float32)[..., None] * inv  # [..., T, D/2]
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class DraftLayer(nn.Module):
    """Pre-norm attention (q/k RMSNorm per head, RoPE) + SwiGLU MLP; keys and values are the
    context's and the block's, through the same projections."""

    def __init__(self, cfg: DsparkConfig) -> None:
        super().__init__()
        d, h, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.cfg = cfg
        self.input_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, h * hd, bias=False)
        self.v_proj = nn.Linear(d, h * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.post_norm = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, K, d] block, ctx [B, W, d] context vectors, pos [B, W + K] positions of (context,
        block), mask [B, 1, K, W + K] True where a slot may attend."""
        cfg = self.cfg
        B, K, _ = x.shape
        hn = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        kv_in = torch.cat([ctx, hn], dim=1)
        q = self.q_proj(hn).view(B, K, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(kv_in).view(B, kv_in.shape[1], cfg.num_heads, cfg.head_dim)
        v = self.v_proj(kv_in).view(B, kv_in.shape[1], cfg.num_heads, cfg.head_dim)
        q = rope(rms_norm(q, self.q_norm, cfg.rms_norm_eps), pos[:, -K:], cfg.rope_theta)
        k = rope(rms_norm(k, self.k_norm, cfg.rms_norm_eps), pos, cfg.rope_theta)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, K, -1))
        gate, up = self.gate_up(rms_norm(x, self.post_norm, cfg.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DsparkModel(nn.Module):
    """The drafter's own weights; the target's embedding and LM head are passed in."""

    def __init__(self, cfg: DsparkConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.tap_layers) * d, d, bias=False)
        self.context_norm = nn.Parameter(torch.ones(d))
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(d))
        if cfg.markov_rank:
            self.markov_in = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
            self.markov_out = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)

    def init_weights(self, seed: int) -> "DsparkModel":
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                with torch.no_grad():
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=g)
        if self.cfg.markov_rank:
            with torch.no_grad():
                self.markov_out.weight.zero_()  # starts as no bias
        with torch.no_grad():
            self.mask_embedding.normal_(0.0, 0.02, generator=g)
        return self

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Tapped target hidden states [..., n_taps * d] -> context vectors [..., d]."""
        return rms_norm(self.fc(taps), self.context_norm, self.cfg.rms_norm_eps)

    def forward(self, ctx: torch.Tensor, ctx_pos: torch.Tensor, ctx_valid: torch.Tensor, anchor: torch.Tensor,
                anchor_pos: torch.Tensor, block: int) -> torch.Tensor:
        """ctx [B, W, d], ctx_pos [B, W], ctx_valid [B, W] bool, anchor [B, d] (the anchor token's
        embedding), anchor_pos [B] -> the block's final-normed hidden states [B, block, d]."""
        B, W, d = ctx.shape
        x = torch.cat([anchor[:, None, :], self.mask_embedding.expand(B, block - 1, d)], dim=1)
        slots = torch.arange(block, device=ctx.device)
        pos = torch.cat([ctx_pos, anchor_pos[:, None] + slots], dim=1)
        causal = slots[None, :] <= slots[:, None]  # [K, K]
        mask = torch.cat([ctx_valid[:, None, :].expand(B, block, W), causal.expand(B, block, block)], dim=2)
        mask = mask[:, None]
        for layer in self.layers:
            x = layer(x, ctx, pos, mask)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor | float:
        """The Markov head's logit bias [..., V] from the previous tokens prev [...]."""
        if not self.cfg.markov_rank:
            return 0.0
        return self.markov_out(self.markov_in(prev))


def save_drafter(model: DsparkModel, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    model.cfg.write(root)
    save_file({k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}, str(root / WEIGHTS_FILE))
    return root


def load_drafter(path: str | Path, device: torch.device | str = "cpu", target_config=None) -> DsparkModel:
    """The drafter at ``path`` in float32, with a clear error for a missing or mismatched file (or,
    given ``target_config``, one that does not fit that target)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"speculative_draft_model_path {str(root)!r} is not a directory")
    cfg = DsparkConfig.read(root)
    if target_config is not None:
        check_target(cfg, target_config, f"the DSPARK drafter {str(root)!r}")
    model = DsparkModel(cfg)
    f = root / WEIGHTS_FILE
    try:
        state = load_file(str(f))
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise ValueError(f"{f}: cannot read the DSPARK drafter's weights ({e})") from None
    want = model.state_dict()
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"{f}: does not match {CONFIG_FILE} (missing {missing[:4]}, unexpected {unexpected[:4]})")
    for k, v in state.items():
        if v.shape != want[k].shape:
            raise ValueError(f"{f}: {k} has shape {list(v.shape)}, {CONFIG_FILE} says {list(want[k].shape)}")
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(device).eval()


@dataclass
class _Context:
    """One request's context vectors by position (``have`` marks the positions seen)."""

    vectors: torch.Tensor
    have: torch.Tensor


class DsparkDrafter:
    """The speculation loop's DSPARK drafter: context from the target's taps, one pass per block."""

    def __init__(self, model: DsparkModel, target: nn.Module) -> None:
        cfg = model.cfg
        check_target(cfg, target.config)
        fp = target_fingerprint(target)
        if cfg.target_fingerprint and cfg.target_fingerprint != fp:
            logger.warning("the DSPARK drafter was trained on another target (fingerprint %s, this one %s): it "
                           "stays exact but will draft poorly; retrain it", cfg.target_fingerprint, fp)
        self.model, self.target, self.cfg = model.eval(), target, cfg
        self.device = next(model.parameters()).device
        self.tap_layers = tuple(cfg.tap_layers)
        self.tap_window = cfg.window
        self._ctx: dict[str, _Context] = {}

    @classmethod
    def from_path(cls, path: str, target: nn.Module, block_size: int) -> "DsparkDrafter":
        model = load_drafter(path, next(target.parameters()).device, target.config)
        if block_size > model.cfg.block_size:
            raise ValueError(f"speculative_dspark_block_size {block_size} exceeds the drafter's trained block size "
                             f"{model.cfg.block_size} ({path})")
        return cls(model, target)

    @torch.inference_mode()
    def observe(self, request_id: str, start: int, taps: torch.Tensor) -> None:
        """The target's tapped hidden states [R, n_taps * d] of committed positions start .. start+R-1."""
        if taps.shape[0] == 0:
            return
        c = self.model.context(taps.to(self.device, torch.float32))
        end = start + c.shape[0]
        st = self._ctx.get(request_id)
        if st is None or st.vectors.shape[0] < end:
            cap = max(end, 2 * (st.vectors.shape[0] if st else 64))
            grown = _Context(torch.zeros(cap, c.shape[1], device=self.device),
                             torch.zeros(cap, dtype=torch.bool, device=self.device))
            if st is not None:
                n = st.vectors.shape[0]
                grown.vectors[:n], grown.have[:n] = st.vectors, st.have
            st = self._ctx[request_id] = grown
        st.vectors[start:end] = c
        st.have[start:end] = True

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.model.embed_tokens(ids).to(torch.float32)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(h.to(self.target.dtype)).to(torch.float32)

    @torch.inference_mode()
    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> Draft | None:
        n, W = len(token_ids), self.cfg.window
        st = self._ctx.get(request_id)
        if st is None or n < 2 or num_tokens < 1:
            return None
        lo, hi = max(0, n - 1 - W), min(n - 1, st.vectors.shape[0])  # context: committed positions < n-1
        st.have[n - 1:] = False  # nothing at or past the anchor is committed-and-seen (a request rewound)
        if hi <= lo or not bool(st.have[lo:hi].any()):
            return None
        k = min(num_tokens, self.cfg.block_size)
        dev = self.device
        ctx = st.vectors[lo:hi][None]
        pos = torch.arange(lo, hi, device=dev)[None]
        anchor = self._embed(torch.tensor([token_ids[-1]], device=dev))
        h = self.model(ctx, pos, st.have[lo:hi][None], anchor, torch.tensor([n - 1], device=dev), k)[0]
        base = self._logits(h)  # [k, V]
        tokens: list[int] = []
        prev = int(token_ids[-1])
        for j in range(k):
            logits = base[j] + self.model.markov_bias(torch.tensor(prev, device=dev))
            prev = int(logits.argmax())
            tokens.append(prev)
        return Draft(tokens)

    def forget(self, request_id: str) -> None:
        self._ctx.pop(request_id, None)
