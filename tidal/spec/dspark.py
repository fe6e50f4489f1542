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
The serving drafter keeps every draft layer's context keys/values per request
(:mod:`tidal.spec.dspark_cache`) and drafts all requests' blocks in one pass.

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

from tidal.model.layers import derived_weight, inference_layout, rms_norm
from tidal.ops import dense
from tidal.ops.markov_draft import draft_slots
from tidal.spec.dspark_cache import DraftContextCache
from tidal.spec.drafter import Draft, confident_prefix

logger = logging.getLogger(__name__)

CONFIG_FILE = "dspark_config.json"
WEIGHTS_FILE = "model.safetensors"
# Up to this many block slots (requests x block size) draft their LM head in one product.
ONE_PRODUCT_ROWS = 16


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


def rope_angles(pos: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., T, 1, dim/2] of integer positions pos [..., T] (shared by every layer)."""
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=pos.device) / dim)
    ang = pos.to(torch.float32)[..., None] * inv  # [..., T, D/2]
    return ang.cos()[..., None, :], ang.sin()[..., None, :]


def apply_rope(x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding (rotate-half) of x [..., T, H, D] with :func:`rope_angles`."""
    cos, sin = angles
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half) of x [..., T, H, D] at integer positions pos [..., T]."""
    return apply_rope(x, rope_angles(pos, x.shape[-1], theta))


def project(owner: nn.Module, x: torch.Tensor, name: str, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """x through each of ``linears``. When serving (inference mode), one product against their
    concatenated weight in bfloat16 (the file's precision: ``save_drafter`` writes bf16), kept on
    ``owner`` until a weight changes; when training, each float32 Linear."""
    if not torch.is_inference_mode_enabled():
        return tuple(lin(x) for lin in linears)
    y = dense.linear(x, serving_weight(owner, name, *linears))
    return y.split([lin.out_features for lin in linears], dim=-1) if len(linears) > 1 else (y,)


def serving_weight(owner: nn.Module, name: str, *linears: nn.Linear) -> torch.Tensor:
    """The bfloat16 concatenation of ``linears``' weights :func:`project` multiplies by."""
    weights = tuple(lin.weight for lin in linears)
    return derived_weight(owner, name, weights, lambda: torch.cat(weights).to(torch.bfloat16).contiguous())


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
        W = ctx.shape[1]
        k, v = self.context_kv(ctx, rope_angles(pos[:, :W], self.cfg.head_dim, self.cfg.rope_theta))
        return self.attend(x, rope_angles(pos[:, W:], self.cfg.head_dim, self.cfg.rope_theta), k, v, mask)

    def context_kv(self, ctx: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [..., W, H, D] of context vectors ctx [..., W, d] (rotated by their
        positions' ``angles``): a context position's are the same in every block that attends to it."""
        cfg = self.cfg
        shape = (*ctx.shape[:-1], cfg.num_heads, cfg.head_dim)
        if torch.is_inference_mode_enabled():  # the k|v rows of the block's q|k|v weight (no second copy)
            qkv = serving_weight(self, "_qkv", self.q_proj, self.k_proj, self.v_proj)
            k, v = dense.linear(ctx, qkv[self.q_proj.out_features :]).chunk(2, dim=-1)
        else:
            k, v = self.k_proj(ctx), self.v_proj(ctx)
        k = apply_rope(rms_norm(k.reshape(shape), self.k_norm, cfg.rms_norm_eps), angles)
        return k, v.reshape(shape)

    def attend(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor], ctx_k: torch.Tensor,
               ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The layer on block x [B, K, d] (rotated by the block positions' ``angles``) attending to
        the context's keys/values [B, W, H, D] and the block's own; mask [B, 1, K, W + K]."""
        cfg = self.cfg
        B, K, _ = x.shape
        hn = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        q, k, v = project(self, hn, "_qkv", self.q_proj, self.k_proj, self.v_proj)
        shape = (B, K, cfg.num_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q.reshape(shape), self.q_norm, cfg.rms_norm_eps), angles)
        k = apply_rope(rms_norm(k.reshape(shape), self.k_norm, cfg.rms_norm_eps), angles)
        keys, values = torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v.reshape(shape)], dim=1)
        scores = q.transpose(1, 2) @ keys.permute(0, 2, 3, 1) * cfg.head_dim ** -0.5  # [B, H, K, W + K]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        o = (probs @ values.transpose(1, 2)).transpose(1, 2).reshape(B, K, -1)
        (o,) = project(self, o, "_o", self.o_proj)
        x = x + o
        gate, up = project(self, rms_norm(x, self.post_norm, cfg.rms_norm_eps), "_gate_up", self.gate_up)[0].chunk(2, dim=-1)
        (down,) = project(self, F.silu(gate) * up, "_down", self.down)
        return x + down


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
        return rms_norm(project(self, taps, "_fc", self.fc)[0], self.context_norm, self.cfg.rms_norm_eps)

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

    def forward_cached(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, block: int,
                       ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_valid: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with every layer's context keys/values given (``ctx_kv``: per layer
        [B, W, H, D] pairs from :meth:`DraftLayer.context_kv`; ctx_valid [B, W] bool)."""
        B, d = anchor.shape
        x = torch.cat([anchor[:, None, :], self.mask_embedding.expand(B, block - 1, d)], dim=1)
        slots = torch.arange(block, device=anchor.device)
        angles = rope_angles(anchor_pos[:, None] + slots, self.cfg.head_dim, self.cfg.rope_theta)
        causal = slots[None, :] <= slots[:, None]
        W = ctx_valid.shape[1]
        mask = torch.cat([ctx_valid[:, None, :].expand(B, block, W), causal.expand(B, block, block)], dim=2)[:, None]
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer.attend(x, angles, k, v, mask)
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


def serving_bytes(cfg: DsparkConfig, max_requests: int) -> int:
    """A serving drafter's memory: its float32 weights, their bfloat16 copies (:func:`project`),
    the bf16 copy of the target's LM head, and the context cache of ``max_requests`` requests."""
    model = DsparkModel(cfg).to("meta")
    weights = sum(p.numel() for p in model.parameters()) * 4
    copies = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "markov_out")
    return weights + 2 * copies + 2 * cfg.vocab_size * cfg.hidden_size + DraftContextCache.bytes_for(
        cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.window, max_requests, len(cfg.tap_layers) * cfg.hidden_size)


# Request slots of the context cache when the engine sets no max_running_requests.
DEFAULT_CONTEXT_REQUESTS = 64


class DsparkDrafter:
    """The speculation loop's DSPARK drafter. Each draft layer's context keys/values are computed
    once, when the target hands a committed position over (:meth:`observe_many`: one pass over
    the step's new positions of every request), and kept per request (:class:`DraftContextCache`);
    :meth:`propose_many` drafts the blocks of every speculating request in one pass over the
    block slots only. :class:`DsparkReferenceDrafter` computes the same proposals uncached."""

    def __init__(self, model: DsparkModel, target: nn.Module, max_requests: int = DEFAULT_CONTEXT_REQUESTS) -> None:
        cfg = model.cfg
        check_target(cfg, target.config)
        fp = target_fingerprint(target)
        if cfg.target_fingerprint and cfg.target_fingerprint != fp:
            logger.warning("the DSPARK drafter was trained on another target (fingerprint %s, this one %s): it "
                           "stays exact but will draft poorly; retrain it", cfg.target_fingerprint, fp)
        self.model, self.target, self.cfg = model.eval(), target, cfg
        self.device = next(model.parameters()).device
        if cfg.markov_rank:  # the same values input-major: the slot loop's kernel streams it along the vocabulary
            model.markov_out.weight.data = inference_layout(model.markov_out.weight)
        self.tap_layers = tuple(cfg.tap_layers)
        self.tap_window = cfg.window
        self.cache = DraftContextCache(cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.window, max_requests,
                                       len(cfg.tap_layers) * cfg.hidden_size, self.device)
        self._warm_up()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One pass over dummy inputs: first-use costs (loading kernels, the bf16 weight copies) are
        paid at start, not in a step the speculation policy measures."""
        cfg, dev = self.cfg, self.device
        ctx = self.model.context(torch.zeros(1, len(cfg.tap_layers) * cfg.hidden_size, device=dev))
        angles = rope_angles(torch.zeros(1, dtype=torch.long, device=dev), cfg.head_dim, cfg.rope_theta)
        kv = [tuple(t[None].expand(1, cfg.window, -1, -1) for t in layer.context_kv(ctx, angles))
              for layer in self.model.layers]
        h = self.model.forward_cached(ctx, torch.zeros(1, dtype=torch.long, device=dev), 1, kv,
                                      torch.zeros(1, cfg.window, dtype=torch.bool, device=dev))
        self._logits(h[0])

    @classmethod
    def from_path(cls, path: str, target: nn.Module, block_size: int,
                  max_requests: int = DEFAULT_CONTEXT_REQUESTS) -> "DsparkDrafter":
        model = load_drafter(path, next(target.parameters()).device, target.config)
        if block_size > model.cfg.block_size:
            raise ValueError(f"speculative_dspark_block_size {block_size} exceeds the drafter's trained block size "
                             f"{model.cfg.block_size} ({path})")
        return cls(model, target, max_requests)

    @staticmethod
    def memory_bytes(path: str, max_requests: int = DEFAULT_CONTEXT_REQUESTS) -> int:
        """What the drafter at ``path`` holds when serving (see :func:`serving_bytes`)."""
        return serving_bytes(DsparkConfig.read(path), max_requests)

    @property
    def nbytes(self) -> int:
        return serving_bytes(self.cfg, self.cache.max_requests)

    def observe(self, request_id: str, start: int, taps: torch.Tensor) -> None:
        """The target's tapped hidden states [R, n_taps * d] of committed positions start .. start+R-1."""
        self.observe_many([(request_id, start, taps)])

    @torch.inference_mode()
    def observe_many(self, items: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        """:meth:`observe` for several requests (each at most once). Several positions of one
        request (a prefill chunk, a verified chain) get their keys and values now, in one pass
        over all such requests: the step that hands them over computes many tokens anyway, and
        the request's first draft then has its context ready (filling every new prompt's context
        at the first draft made that step the slowest of a run). A single position (a plain
        decode) is only kept, its keys and values computed when the request next drafts: a step
        that does not speculate costs one copy. Only a request's last ``window`` positions can
        be attended to, so earlier ones are not kept; a request that finds every cache slot taken
        keeps no context (it does not speculate)."""
        W = self.cfg.window
        rows, slots, positions, now = [], [], [], []
        for request_id, start, taps in items:
            n = taps.shape[0]
            slot = self.cache.slot(request_id, create=True) if n else None
            if slot is None:
                continue
            keep = min(n, W)
            now += [n > 1] * keep
            rows.append(taps[n - keep :])
            slots += [slot] * keep
            positions += range(start + n - keep, start + n)
        if not rows:
            return
        dev = self.device
        slot_t, pos_t = torch.tensor(slots, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev)
        taps_t = torch.cat(rows).to(dev, torch.float32)
        self.cache.stage(slot_t, pos_t, taps_t)
        if any(now):
            eager = torch.tensor(now, dtype=torch.bool, device=dev)
            self._project_rows(slot_t[eager] * W + pos_t[eager] % W, pos_t[eager], taps_t[eager])

    @torch.inference_mode()
    def observe_decodes(self, request_ids: Sequence[str], positions: Sequence[int], taps: torch.Tensor) -> None:
        """:meth:`observe_many` for plain decodes (one position each: request ``request_ids[i]``'s
        position ``positions[i]``, tapped states ``taps[i]``), with the rows handed over as one
        tensor: kept, their keys and values computed when the request next drafts."""
        slots = [self.cache.slot(rid, create=True) for rid in request_ids]
        if None in slots:  # requests that found every cache slot taken keep no context
            keep = [i for i, s in enumerate(slots) if s is not None]
            if not keep:
                return
            slots, positions = [slots[i] for i in keep], [positions[i] for i in keep]
            taps = taps[torch.tensor(keep, dtype=torch.long, device=taps.device)]
        self.cache.stage(slots, positions, taps)

    def _project(self, slots: torch.Tensor) -> None:
        """Compute the keys/values of the handed-over positions of ``slots`` not computed yet."""
        self._project_rows(*self.cache.pending(slots))

    def _project_rows(self, rows: torch.Tensor, pos: torch.Tensor, taps: torch.Tensor) -> None:
        """Flat cache ``rows`` [P] get every draft layer's keys/values of the tapped states
        ``taps`` [P, n_taps * d] at positions ``pos`` [P] (each row's independent of the others)."""
        if rows.numel():
            ctx = self.model.context(taps)
            angles = rope_angles(pos, self.cfg.head_dim, self.cfg.rope_theta)
            self.cache.write(rows, [layer.context_kv(ctx, angles) for layer in self.model.layers])

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.model.embed_tokens(ids).to(torch.float32)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The target's LM head on draft states, read in bfloat16: a float32 target's exact bf16 copy
        where its decode keeps one (``dense.bf16_twin``; the bytes ``nbytes`` counts for the
        drafter's copy then pay for that one), else a copy kept beside a wider target's."""
        w = self.target.lm_head.weight
        if w.device.type != "cpu" or w.dim() != 2:
            return self.target.compute_logits(h.to(self.target.dtype)).to(torch.float32)
        twin = dense.bf16_twin(w) if w.dtype == torch.float32 else None
        head = twin if twin is not None else derived_weight(self, "_lm_head", (w,),
                                                            lambda: w.detach().to(torch.bfloat16).contiguous())
        return dense.linear(h.to(torch.float32), head)

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int,
                min_reach: float = 0.0) -> Draft | None:
        return self.propose_many([(request_id, token_ids, num_tokens)], min_reach)[0]

    @torch.inference_mode()
    def propose_many(self, asks: Sequence[tuple[str, Sequence[int], int]], min_reach: float = 0.0
                     ) -> list[Draft | None]:
        """A block for each (request, its tokens, drafts wanted), all in one pass; None where a
        request has no context yet. Every request runs the largest block asked for: the slots are
        causal, so a request's first tokens are those of its own block size. Each block is cut
        before its first token whose chance of being reached is below ``min_reach``
        (:func:`confident_prefix`), and the slots are drafted one at a time (LM head, Markov
        head) for the blocks still going: in a full batch, where only sure tokens are verified,
        most of the vocabulary-wide work is never done."""
        out: list[Draft | None] = [None] * len(asks)
        live = [(i, slot, len(ids), min(k, self.cfg.block_size), int(ids[-1])) for i, (rid, ids, k) in enumerate(asks)
                if len(ids) >= 2 and k >= 1 and (slot := self.cache.slot(rid)) is not None]
        if not live:
            return out
        dev, W = self.device, self.cfg.window
        slots = torch.tensor([x[1] for x in live], dtype=torch.long, device=dev)
        anchor_pos = torch.tensor([x[2] - 1 for x in live], dtype=torch.long, device=dev)
        self._project(slots)
        kv, pos = self.cache.gather(slots)
        # Context: the committed positions max(0, n-1-W) .. n-2 that the cache holds.
        valid = (pos >= (anchor_pos - W).clamp(min=0)[:, None]) & (pos < anchor_pos[:, None])
        has = valid.any(dim=1)
        if not bool(has.all()):
            keep = has.nonzero().flatten()
            live = [live[j] for j in keep.tolist()]
            if not live:
                return out
            kv, valid, anchor_pos = [(k[keep], v[keep]) for k, v in kv], valid[keep], anchor_pos[keep]
        block = max(x[3] for x in live)
        prev = torch.tensor([x[4] for x in live], dtype=torch.long, device=dev)
        h = self.model.forward_cached(self._embed(prev), anchor_pos, block, kv, valid)
        B = len(live)
        drafted = torch.full((B, block), -1, dtype=torch.long, device=dev)
        confidence = torch.zeros(B, block, device=dev)
        wanted = torch.tensor([x[3] for x in live], device=dev)
        reach = torch.ones(B, device=dev)
        rows = torch.arange(B, device=dev)  # the blocks still drafting
        # A slot's LM head does not depend on the drafts before it (only the Markov bias does): a
        # few blocks take every slot's in one product, reading the vocabulary-wide weight once,
        # not once a slot; more rows take it slot by slot for the blocks still going. Each row's
        # logits are the same bits either way (the product is row-invariant).
        head = self._logits(h.reshape(B * block, -1)).view(B, block, -1) if B * block <= ONE_PRODUCT_ROWS else None
        fast = None
        if head is not None:  # the rest of the block in one call where the kernel applies
            markov = (self.model.markov_in.weight, self.model.markov_out.weight) if self.cfg.markov_rank else (None, None)
            fast = draft_slots(head, *markov, prev, wanted, min_reach)
        if fast is not None:
            drafted, confidence = fast
        else:
            for j in range(block):  # the Markov head: each slot's bias comes from the previous draft
                base = head[rows, j] if head is not None else self._logits(h[rows, j])
                logits = base + self.model.markov_bias(prev[rows])
                top, token = logits.max(dim=-1)
                conf = (top - logits.logsumexp(dim=-1)).exp()  # the draft's own probability
                drafted[rows, j], confidence[rows, j], prev[rows] = token, conf, token
                reach[rows] *= conf
                # a block stops at its own size, or once it cannot be reached (with a margin: the cut
                # itself is confident_prefix's, in float64)
                going = wanted[rows] > j + 1
                if min_reach > 0.0:
                    going &= reach[rows] >= min_reach * (1 - 1e-3)
                rows = rows[going]
                if not rows.numel():
                    break
        for (i, _, _, k, _), tokens, conf in zip(live, drafted.tolist(), confidence.tolist()):
            draft = Draft(tokens[:k], confidence=conf[:k])
            cut = confident_prefix(draft, min_reach)
            out[i] = Draft(draft.tokens[:cut], confidence=draft.confidence[:cut])
        return out

    def forget(self, request_id: str) -> None:
        self.cache.release(request_id)


@dataclass
class _Context:
    """One request's context vectors by position (``have`` marks the positions seen)."""

    vectors: torch.Tensor
    have: torch.Tensor


class DsparkReferenceDrafter(DsparkDrafter):
    """The uncached reference of :class:`DsparkDrafter` (tests compare them): each request keeps
    its context vectors by position, and every proposal runs the whole drafter over its window of
    context and its block, one request at a time."""

    def __init__(self, model: DsparkModel, target: nn.Module) -> None:
        super().__init__(model, target, max_requests=1)
        self._ctx: dict[str, _Context] = {}

    @torch.inference_mode()
    def observe_many(self, items: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        for request_id, start, taps in items:
            if taps.shape[0] == 0:
                continue
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

    @torch.inference_mode()
    def propose_many(self, asks: Sequence[tuple[str, Sequence[int], int]], min_reach: float = 0.0
                     ) -> list[Draft | None]:
        out = []
        for ask in asks:  # every token of the block drafted, then cut
            d = self._propose(*ask)
            out.append(d if d is None else Draft(d.tokens[: (c := confident_prefix(d, min_reach))], confidence=d.confidence[:c]))
        return out

    def _propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> Draft | None:
        n, W = len(token_ids), self.cfg.window
        st = self._ctx.get(request_id)
        if st is None or n < 2 or num_tokens < 1:
            return None
        lo, hi = max(0, n - 1 - W), min(n - 1, st.vectors.shape[0])  # context: committed positions < n-1
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
        confidence: list[float] = []
        prev = int(token_ids[-1])
        for j in range(k):
            logits = base[j] + self.model.markov_bias(torch.tensor(prev, device=dev))
            prev = int(logits.argmax())
            tokens.append(prev)
            confidence.append(float(logits.double().softmax(dim=-1)[prev]))
        return Draft(tokens, confidence=confidence)

    def forget(self, request_id: str) -> None:
        self._ctx.pop(request_id, None)
