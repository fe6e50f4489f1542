"""Memory planner: weights, KDA state and MLA KV per rank, and what fits in what is left.

A hybrid model splits the memory left after its weights between per-request KDA state (fixed size,
whatever the context) and per-token MLA KV. ``tidal plan`` answers before launch how many requests
and tokens that memory holds, in tidal's single pool and in SGLang's ratio split
(``--mamba-full-memory-ratio``), and which ratio a workload needs. The engine sizes its pool with
the same functions (:func:`pool_layout`, :func:`plan_for_pool`) and prints the same table, so what
the planner says is what the server does.

Everything is counted from :class:`ModelConfig` by formula, never by reading a checkpoint.

Sharding over one tensor-parallel group of ``tp`` ranks (``--num-gpus`` must equal ``--tp-size``;
DCP and EP reuse those ranks, as SGLang does):

* TP splits attention heads (KDA q/k/v/g projections, short convs, gates, dt_bias, A_log, o_proj;
  MLA q_b/kv_b/g/o projections) and MLP intermediates (dense MLP, shared experts).
* EP splits routed experts: ``ep`` divides ``tp``; each rank holds ``E/ep`` experts, each cut
  along its intermediate into ``tp/ep`` slices (``ep = 1`` is pure TP on experts).
* Embeddings and lm_head are vocab-parallel: ``ceil(vocab/tp)`` rows per rank.
* Replicated on every rank: every RMSNorm weight (block norms, final norm, MLA q_a/kv_a norms, KDA
  o_norm, latent-MoE norm), the router and its bias, AttnRes, the latent-MoE projections (the
  experts all-reduce, so the latent entering and leaving them is full width on every rank), the
  low-rank KDA f_a/g_a projections and MLA q_a/kv_a projections (their outputs feed every head).

Per-rank caches: KDA state is split by heads over TP and is whole on every DCP rank; MLA's latent
KV is shared by all heads, so without DCP every rank holds every token, and with DCP each rank of
a DCP group holds 1/dcp of the tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tidal.config import ConfigError, ModelConfig, parse_dtype

GIB = 1 << 30
MIB = 1 << 20
FP32 = 4
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "fp8": 1}
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
DEFAULT_PAGE_SIZE = 16
# Inside the static fraction but outside weights and pool: CUDA context, NCCL and MoE workspace
# buffers, CUDA-graph private pools. The (1 - mem_fraction_static) share is left for activations.
DEFAULT_RESERVE_BYTES = 2 * GIB
SGLANG_DEFAULT_RATIO = 0.9
# SGLang state slots per running request with the radix cache on (MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO);
# 1 with the radix cache disabled, 5 with the extra-buffer strategy under overlap scheduling.
SGLANG_DEFAULT_SLOTS_PER_REQUEST = 3
# The published K3 checkpoint ships A_log as [128] for its 96 KDA heads (k3-model.md §1.2); a rank
# loads only its H/tp heads, so this changes the on-disk total only (32 floats per KDA layer).
PUBLISHED_A_LOG_VALUES = {"kimi-k3": 128}


class PlanError(ValueError):
    """A set-up that cannot run; the message says why and by how much."""


# ---- cache sizes ---------------------------------------------------------------------------------


def kda_state_bytes_per_request(config: ModelConfig, *, tp_size: int = 1, conv_dtype_bytes: int = 2) -> int:
    """One request's KDA state on one rank, all KDA layers: conv (3P/tp x (W-1)) in the model dtype
    plus recurrent (H/tp x K x K) float32. Independent of context length and of DCP."""
    H, K, W = config.kda_num_heads, config.kda_head_dim, config.kda_conv_kernel
    conv = 3 * H * K // tp_size * (W - 1) * conv_dtype_bytes
    recurrent = H // tp_size * K * K * FP32
    return config.num_kda_layers * (conv + recurrent)


def mla_kv_bytes_per_token(config: ModelConfig, *, kv_dtype_bytes: int = 2) -> int:
    """One stored token's MLA cache on one rank, all MLA layers: latent c plus k_pe. The latent is
    shared by all heads, so TP does not split it; DCP changes which rank stores a token, not its size."""
    return config.num_mla_layers * config.mla_cache_width * kv_dtype_bytes


# ---- tidal's single pool -------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolLayout:
    """tidal's single pool. The pool is num_blocks equal blocks; a block holds either ONE request's
    KDA state (all KDA layers) or pages_per_block MLA KV pages of page_size tokens. So memory moves
    freely between state and KV with no ratio.

    With speculative decoding of D draft tokens a running request holds 1 + D state blocks (the
    state after each draft, so a rejected suffix rolls back by choosing a block) and D tokens of KV
    headroom."""

    pool_bytes: int
    page_size: int
    page_bytes: int
    state_bytes: int
    pages_per_block: int
    num_blocks: int
    dcp_size: int
    spec_draft_tokens: int = 0

    @property
    def block_bytes(self) -> int:
        return self.pages_per_block * self.page_bytes

    @property
    def kv_tokens_per_rank(self) -> int:
        """Tokens stored on a rank with the whole pool used as KV."""
        return self.num_blocks * self.pages_per_block * self.page_size

    @property
    def kv_tokens_logical(self) -> int:
        """Tokens across the DCP group (each rank stores 1/dcp of a request's tokens)."""
        return self.kv_tokens_per_rank * self.dcp_size

    @property
    def state_slots(self) -> int:
        """Requests' states that fit with the whole pool used as state."""
        return self.num_blocks

    @property
    def state_blocks_per_request(self) -> int:
        return 1 + self.spec_draft_tokens

    def pages_per_request(self, context_len: int) -> int:
        """KV pages one request of context_len logical tokens needs on each DCP rank."""
        tokens = max(context_len, 0) + self.spec_draft_tokens
        return -(-tokens // (self.dcp_size * self.page_size))

    def max_requests(self, context_len: int) -> int:
        """Concurrent requests of context_len tokens each that fit: the largest n with
        n*s + ceil(n*p / pages_per_block) <= num_blocks (s state blocks and p pages per request),
        which is n*(p + pages_per_block*s) <= pages_per_block*num_blocks."""
        s, p, ppb = self.state_blocks_per_request, self.pages_per_request(context_len), self.pages_per_block
        return ppb * self.num_blocks // (p + ppb * s)

    def max_context_len(self) -> int:
        """The longest single request: its state blocks, every other block as KV."""
        kv_blocks = self.num_blocks - self.state_blocks_per_request
        if kv_blocks <= 0:
            return 0
        return kv_blocks * self.pages_per_block * self.page_size * self.dcp_size - self.spec_draft_tokens


def pool_layout(
    config: ModelConfig,
    pool_bytes: int,
    *,
    page_size: int = DEFAULT_PAGE_SIZE,
    kv_dtype_bytes: int = 2,
    conv_dtype_bytes: int = 2,
    tp_size: int = 1,
    dcp_size: int = 1,
    spec_draft_tokens: int = 0,
) -> PoolLayout:
    """Cut pool_bytes (one rank's pool) into blocks: block_bytes is one request's state rounded up
    to a whole number of KV pages (at least one page)."""
    if config.num_mla_layers == 0:
        raise PlanError("the pool needs at least one MLA layer (a config without MLA has no KV pages)")
    if page_size <= 0:
        raise PlanError(f"page size must be > 0, got {page_size}")
    state = kda_state_bytes_per_request(config, tp_size=tp_size, conv_dtype_bytes=conv_dtype_bytes)
    page = page_size * mla_kv_bytes_per_token(config, kv_dtype_bytes=kv_dtype_bytes)
    pages_per_block = max(1, -(-state // page))
    block = pages_per_block * page
    need = (1 + spec_draft_tokens) * block
    if pool_bytes < need:
        raise PlanError(
            f"the pool ({_gib(pool_bytes)}) cannot hold one request's KDA state "
            f"({1 + spec_draft_tokens} block(s) of {_mib(block)} = {_gib(need)}); free more memory per rank"
        )
    return PoolLayout(
        pool_bytes=pool_bytes,
        page_size=page_size,
        page_bytes=page,
        state_bytes=state,
        pages_per_block=pages_per_block,
        num_blocks=pool_bytes // block,
        dcp_size=dcp_size,
        spec_draft_tokens=spec_draft_tokens,
    )


# ---- weights -------------------------------------------------------------------------------------

WEIGHT_KINDS = (
    "embeddings",
    "lm_head",
    "kda",
    "mla",
    "dense_mlp",
    "shared_experts",
    "routed_experts",
    "router",
    "latent_proj",
    "norms",
    "attn_res",
)


@dataclass(frozen=True)
class WeightShare:
    """One kind of weight: bytes of the whole checkpoint and bytes one rank holds."""

    kind: str
    sharding: str
    total_bytes: int
    per_rank_bytes: int


class _Tally:
    """Adds tensors to kinds: total and per-rank bytes."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(WEIGHT_KINDS, 0)
        self.rank = dict.fromkeys(WEIGHT_KINDS, 0)

    def add(self, kind: str, total_bytes: int, rank_bytes: int, times: int = 1) -> None:
        self.total[kind] += times * total_bytes
        self.rank[kind] += times * rank_bytes

    def matrix(
        self, kind: str, out: int, inp: int, dtype_bytes: int, *, out_split: int = 1, in_split: int = 1, times: int = 1
    ) -> None:
        """A [out, inp] weight; TP cuts rows (column-parallel) or columns (row-parallel)."""
        self.add(kind, out * inp * dtype_bytes, out // out_split * (inp // in_split) * dtype_bytes, times)


def mxfp4_bytes(out: int, inp: int) -> int:
    """An [out, inp] MXFP4 weight: packed nibbles (inp/2 bytes a row) + one E8M0 byte per 32 inputs."""
    return out * (inp // 2) + out * (inp // 32)


def _dtype_bytes(config: ModelConfig) -> int:
    return parse_dtype(config.torch_dtype).itemsize


def weight_breakdown(
    config: ModelConfig, *, tp_size: int = 1, ep_size: int = 1, a_log_values: int | None = None
) -> tuple[WeightShare, ...]:
    """Bytes per kind of weight as stored (checkpoint dtypes), whole and per rank.

    Kinds: a layer's own norms count with the layer (KDA o_norm, MLA q_a/kv_a norms, the latent-MoE
    norm); "norms" are the block norms and the final norm.

    On-disk dtypes: A_log, dt_bias and the router's e_score_correction_bias are float32, and in K3
    also q/k/v_conv1d and KDA o_norm; routed experts are MXFP4 (4.25 bits a parameter) when
    ``expert_format`` says so; everything else is ``torch_dtype``. A_log holds H values (one per
    head) or, in the "channel" layout, K; ``a_log_values`` overrides the on-disk count (see
    PUBLISHED_A_LOG_VALUES)."""
    c, tp, ep = config, tp_size, ep_size
    b, f32 = _dtype_bytes(c), max(FP32, _dtype_bytes(c))
    wide = f32 if c.model_type == "kimi_k3" else b  # K3 also stores its convs and o_norm in float32
    d, t = c.hidden_size, _Tally()

    vocab_rows = -(-c.vocab_size // tp)
    t.add("embeddings", c.vocab_size * d * b, vocab_rows * d * b)
    if not c.tie_word_embeddings:
        t.add("lm_head", c.vocab_size * d * b, vocab_rows * d * b)
    t.add("norms", d * b, d * b)  # final norm
    t.add("norms", 2 * d * b, 2 * d * b, c.num_hidden_layers)  # input / post-attention norms

    # KDA
    n, H, K, W = c.num_kda_layers, c.kda_num_heads, c.kda_head_dim, c.kda_conv_kernel
    P = H * K
    gates = 4 if c.kda_full_rank_gate else 3  # q, k, v (+ g)
    t.matrix("kda", P, d, b, out_split=tp, times=n * gates)
    t.add("kda", 3 * P * W * wide, 3 * P // tp * W * wide, n)  # q/k/v_conv1d [P, 1, W]
    t.matrix("kda", K, d, b, times=n)  # f_a_proj
    t.matrix("kda", P, K, b, out_split=tp, times=n)  # f_b_proj
    if not c.kda_full_rank_gate:
        t.matrix("kda", K, d, b, times=n)  # g_a_proj
        t.matrix("kda", P, K, b, out_split=tp, times=n)  # g_b_proj
    t.matrix("kda", H, d, b, out_split=tp, times=n)  # b_proj
    if c.kda_a_log_layout == "head":
        t.add("kda", (a_log_values or H) * f32, H // tp * f32, n)
    else:
        t.add("kda", (a_log_values or K) * f32, K * f32, n)
    t.add("kda", P * f32, P // tp * f32, n)  # dt_bias
    t.add("kda", K * wide, K * wide, n)  # o_norm
    t.matrix("kda", d, P, b, in_split=tp, times=n)  # o_proj

    # MLA
    m, heads = c.num_mla_layers, c.num_attention_heads
    if c.q_lora_rank is None:
        t.matrix("mla", heads * c.qk_head_dim, d, b, out_split=tp, times=m)
    else:
        t.matrix("mla", c.q_lora_rank, d, b, times=m)  # q_a_proj
        t.add("mla", c.q_lora_rank * b, c.q_lora_rank * b, m)  # q_a_layernorm
        t.matrix("mla", heads * c.qk_head_dim, c.q_lora_rank, b, out_split=tp, times=m)  # q_b_proj
    t.matrix("mla", c.mla_cache_width, d, b, times=m)  # kv_a_proj_with_mqa
    t.add("mla", c.kv_lora_rank * b, c.kv_lora_rank * b, m)  # kv_a_layernorm
    t.matrix("mla", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, b, out_split=tp, times=m)
    if c.mla_use_output_gate:
        t.matrix("mla", heads * c.v_head_dim, d, b, out_split=tp, times=m)  # g_proj
    t.matrix("mla", d, heads * c.v_head_dim, b, in_split=tp, times=m)  # o_proj

    # MLP / MoE
    moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    dense = c.num_hidden_layers - moe
    t.matrix("dense_mlp", c.intermediate_size, d, b, out_split=tp, times=2 * dense)
    t.matrix("dense_mlp", d, c.intermediate_size, b, in_split=tp, times=dense)
    if moe:
        E, I, de = c.num_experts, c.moe_intermediate_size, c.expert_hidden_size
        t.matrix("router", E, d, b, times=moe)
        t.add("router", E * f32, E * f32, moe)  # e_score_correction_bias
        shared = I * c.num_shared_experts
        t.matrix("shared_experts", shared, d, b, out_split=tp, times=2 * moe)
        t.matrix("shared_experts", d, shared, b, in_split=tp, times=moe)
        i_rank = I // (tp // ep)
        if c.expert_format == "mxfp4-pack-quantized":
            whole = 2 * mxfp4_bytes(I, de) + mxfp4_bytes(de, I)
            rank = 2 * mxfp4_bytes(i_rank, de) + mxfp4_bytes(de, i_rank)
        else:
            whole, rank = 3 * I * de * b, 3 * i_rank * de * b
        t.add("routed_experts", E * whole, E // ep * rank, moe)
        if c.is_latent_moe:
            t.matrix("latent_proj", de, d, b, times=2 * moe)  # routed_expert_down_proj, up_proj
            if c.latent_moe_use_norm:
                t.add("latent_proj", de * b, de * b, moe)  # routed_expert_norm

    if c.attn_res_block_size:
        t.add("attn_res", 4 * d * b, 4 * d * b, c.num_hidden_layers)
        t.add("attn_res", 2 * d * b, 2 * d * b)

    return tuple(
        WeightShare(kind, _SHARDING[kind], t.total[kind], t.rank[kind]) for kind in WEIGHT_KINDS if t.total[kind]
    )


_SHARDING = {
    "embeddings": "vocab-parallel (TP)",
    "lm_head": "vocab-parallel (TP)",
    "kda": "TP (heads); f_a/g_a, o_norm replicated",
    "mla": "TP (heads); q_a/kv_a replicated",
    "dense_mlp": "TP (intermediate)",
    "shared_experts": "TP (intermediate)",
    "routed_experts": "EP (experts) x TP/EP (intermediate)",
    "router": "replicated",
    "latent_proj": "replicated",
    "norms": "replicated",
    "attn_res": "replicated",
}


def weight_bytes(config: ModelConfig, **kw: Any) -> int:
    """The whole checkpoint's tensor bytes (``weight_breakdown`` summed)."""
    return sum(w.total_bytes for w in weight_breakdown(config, **kw))


# ---- parallel set-up -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Parallel:
    tp_size: int = 1
    dcp_size: int = 1
    ep_size: int = 1
    num_gpus: int | None = None  # None: equal to tp_size


def check_parallel(config: ModelConfig, par: Parallel) -> None:
    """Raise PlanError naming the first size that does not divide what it shards."""
    c, tp, dcp, ep = config, par.tp_size, par.dcp_size, par.ep_size
    for name, v in (("--tp-size", tp), ("--dcp-size", dcp), ("--ep-size", ep)):
        if v < 1:
            raise PlanError(f"{name} must be >= 1, got {v}")
    if par.num_gpus is not None and par.num_gpus != tp:
        raise PlanError(
            f"--num-gpus ({par.num_gpus}) must equal --tp-size ({tp}): tidal plans one tensor-parallel group "
            "(no data or pipeline parallelism); DCP and EP reuse its ranks"
        )
    checks = [
        (c.kda_num_heads % tp, f"--tp-size {tp} does not divide the {c.kda_num_heads} KDA heads"),
        (c.num_attention_heads % tp, f"--tp-size {tp} does not divide the {c.num_attention_heads} MLA heads"),
        (tp % dcp, f"--dcp-size {dcp} does not divide --tp-size {tp} (DCP reuses the TP ranks)"),
        (tp % ep, f"--ep-size {ep} does not divide --tp-size {tp} (EP reuses the TP ranks)"),
    ]
    if c.num_experts:
        checks.append((c.num_experts % ep, f"--ep-size {ep} does not divide the {c.num_experts} routed experts"))
    for bad, msg in checks:
        if bad:
            raise PlanError(msg)
    widths = [("dense MLP intermediate", c.intermediate_size, tp)]
    if c.num_experts:
        widths.append(("shared-expert intermediate", c.moe_intermediate_size * c.num_shared_experts, tp))
        widths.append(("routed-expert intermediate", c.moe_intermediate_size, tp // ep))
    for name, width, parts in widths:
        if width % parts:
            raise PlanError(f"the {name} ({width}) does not split into {parts} equal TP slices")
    if c.num_experts and c.expert_format == "mxfp4-pack-quantized" and c.moe_intermediate_size // (tp // ep) % 32:
        raise PlanError(
            f"routed-expert intermediate slice {c.moe_intermediate_size // (tp // ep)} (of {c.moe_intermediate_size} "
            f"over TP/EP = {tp // ep}) is not a multiple of 32, the MXFP4 scale group; raise --ep-size"
        )


# ---- workload and SGLang's split -----------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    isl: int
    osl: int
    concurrency: int

    @property
    def context_len(self) -> int:
        """Tokens a request holds at its end."""
        return self.isl + self.osl

    @classmethod
    def parse(cls, text: str) -> "Workload":
        """``"isl=8192,osl=1024,concurrency=50"``."""
        fields: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in ("isl", "osl", "concurrency"):
                raise PlanError(f"--workload: cannot read {part!r}; expected isl=N,osl=N,concurrency=N")
            try:
                fields[key.strip()] = int(value)
            except ValueError:
                raise PlanError(f"--workload: {key.strip()} must be an integer, got {value!r}") from None
        missing = [k for k in ("isl", "osl", "concurrency") if k not in fields]
        if missing:
            raise PlanError(f"--workload is missing {', '.join(missing)} (isl=N,osl=N,concurrency=N)")
        if fields["isl"] < 0 or fields["osl"] < 0 or fields["concurrency"] < 1 or fields["isl"] + fields["osl"] < 1:
            raise PlanError(f"--workload {text!r}: lengths must be >= 0 with a total >= 1, concurrency >= 1")
        return cls(**fields)


@dataclass(frozen=True)
class SGLangSplit:
    """SGLang's state/KV split of one rank's memory (serving-engines.md §1.1), step by step."""

    ratio: float
    rest_bytes: int  # step 1: memory after weights
    state_budget_bytes: int  # step 3: rest * R / (1 + R)
    state_bytes_per_request: int
    state_slots: int  # max_mamba_cache_size
    slots_per_request: int
    spec_scratch_bytes: int  # step 4: D states per running request, inside the state budget
    kv_bytes_per_token: int  # cell_size
    kv_tokens_per_rank: int  # step 5: max_total_num_tokens, page-rounded
    dcp_size: int
    page_size: int
    spec_draft_tokens: int
    max_running_requests: int  # step 6

    @property
    def kv_tokens_logical(self) -> int:
        return self.kv_tokens_per_rank * self.dcp_size

    def tokens_per_rank(self, context_len: int) -> int:
        """Page-rounded KV tokens one request of context_len tokens holds on a DCP rank."""
        per_page = self.dcp_size * self.page_size
        return -(-(context_len + self.spec_draft_tokens) // per_page) * self.page_size

    def max_context_len(self) -> int:
        return max(0, self.kv_tokens_logical - self.spec_draft_tokens) if self.state_slots >= 1 else 0

    def max_requests(self, context_len: int) -> int:
        """Requests of context_len tokens that run together: slot cap and KV both hold."""
        return min(self.max_running_requests, self.kv_tokens_per_rank // self.tokens_per_rank(context_len))


def sglang_split(
    config: ModelConfig,
    rest_bytes: int,
    *,
    ratio: float = SGLANG_DEFAULT_RATIO,
    tp_size: int = 1,
    dcp_size: int = 1,
    page_size: int = DEFAULT_PAGE_SIZE,
    kv_dtype_bytes: int = 2,
    conv_dtype_bytes: int = 2,
    spec_draft_tokens: int = 0,
    slots_per_request: int = SGLANG_DEFAULT_SLOTS_PER_REQUEST,
    max_running_requests: int | None = None,
) -> SGLangSplit:
    """Reproduce ``profile_max_num_token`` / ``handle_max_mamba_cache`` with r = ratio (state:KV).

    Speculative decoding follows the newer joint solve: slots = budget / (per_req * (1 + D/slots_per_req)),
    and the D intermediate states of each running request are taken before the KV is sized."""
    if ratio <= 0:
        raise PlanError(f"--mamba-full-memory-ratio must be > 0, got {ratio}")
    per_req = kda_state_bytes_per_request(config, tp_size=tp_size, conv_dtype_bytes=conv_dtype_bytes)
    cell = mla_kv_bytes_per_token(config, kv_dtype_bytes=kv_dtype_bytes)
    D, spr = spec_draft_tokens, slots_per_request
    budget = int(rest_bytes * ratio / (1 + ratio))
    slots = budget * spr // (per_req * (spr + D)) if per_req else 0
    scratch = D * per_req * (slots // spr)
    tokens = max(0, rest_bytes - slots * per_req - scratch) // cell // page_size * page_size
    cap = max_running_requests
    if cap is None:
        cap = min(max(int(tokens * dcp_size / config.max_position_embeddings * 512), 2048), 4096)
    return SGLangSplit(
        ratio=ratio,
        rest_bytes=rest_bytes,
        state_budget_bytes=budget,
        state_bytes_per_request=per_req,
        state_slots=slots,
        slots_per_request=spr,
        spec_scratch_bytes=scratch,
        kv_bytes_per_token=cell,
        kv_tokens_per_rank=tokens,
        dcp_size=dcp_size,
        page_size=page_size,
        spec_draft_tokens=D,
        max_running_requests=min(cap, slots // spr),
    )


@dataclass(frozen=True)
class Recommendation:
    """The mamba_full_memory_ratio SGLang needs for a workload, and tidal's pool beside it."""

    workload: Workload
    ratio: float | None  # None: no ratio fits
    ratio_min: float | None  # smallest R with enough state slots
    ratio_max: float | None  # largest R with enough KV
    state_bytes_needed: int
    kv_bytes_needed: int
    reason: str
    sglang: SGLangSplit | None  # the split at the recommended ratio
    tidal_max_requests: int
    tidal_max_context_len: int


def recommend_ratio(
    config: ModelConfig, rest_bytes: int, workload: Workload, layout: PoolLayout, **split_kw: Any
) -> Recommendation:
    """Smallest R (2 decimals) that gives SGLang the workload's concurrency in state slots while its
    KV still holds concurrency x (isl + osl) tokens; whatever the state does not need goes to KV."""
    probe = sglang_split(config, rest_bytes, **split_kw)
    spr, D, n = probe.slots_per_request, probe.spec_draft_tokens, workload.concurrency
    state_need = n * probe.state_bytes_per_request * (spr + D)
    kv_need = n * probe.tokens_per_rank(workload.context_len) * probe.kv_bytes_per_token
    lo = state_need / (rest_bytes - state_need) if rest_bytes > state_need else None
    hi = (rest_bytes - kv_need) / kv_need if rest_bytes > kv_need else None
    tidal = dict(
        tidal_max_requests=layout.max_requests(workload.context_len), tidal_max_context_len=layout.max_context_len()
    )
    base = dict(workload=workload, ratio_min=lo, ratio_max=hi, state_bytes_needed=state_need, kv_bytes_needed=kv_need)
    cap = split_kw.get("max_running_requests")
    if cap is not None and cap < n:
        return Recommendation(
            ratio=None, reason=f"--max-running-requests {cap} is below the concurrency {n}", sglang=None,
            **base, **tidal,
        )
    if lo is None or hi is None or lo > hi:
        return Recommendation(
            ratio=None,
            reason=(
                f"no ratio fits: {n} requests need {_gib(state_need)} of state slots ({spr + D} states each) "
                f"plus {_gib(kv_need)} of KV, but {_gib(rest_bytes)} is left after weights"
            ),
            sglang=None,
            **base,
            **tidal,
        )
    r = math.ceil(lo * 100) / 100
    while r <= hi + 1e-9:
        split = sglang_split(config, rest_bytes, **{**split_kw, "ratio": r})
        if split.max_requests(workload.context_len) >= n:
            reason = f"{n} requests of {workload.context_len} tokens need R in [{lo:.3f}, {hi:.3f}]"
            return Recommendation(ratio=r, reason=reason, sglang=split, **base, **tidal)
        if split.state_slots // spr >= n and split.max_running_requests < n:
            return Recommendation(
                ratio=None,
                reason=f"SGLang caps running requests at {split.max_running_requests}; set --max-running-requests",
                sglang=split,
                **base,
                **tidal,
            )
        r = round(r + 0.01, 2)
    return Recommendation(
        ratio=None, reason=f"no 2-decimal ratio fits in [{lo:.4f}, {hi:.4f}]", sglang=None, **base, **tidal
    )


# ---- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Everything ``tidal plan`` prints: inputs, weights per rank, pool, capacities."""

    model: str
    engine: str  # "tidal" or "sglang": which accounting the top-level capacities follow
    parallel: Parallel
    gpu_memory_bytes: int | None  # None: pool measured on the device
    mem_fraction_static: float | None
    reserve_bytes: int
    kv_dtype: str
    page_size: int
    spec_draft_tokens: int
    workload: Workload | None
    weights: tuple[WeightShare, ...]
    weights_bytes_per_rank: int
    weights_measured: bool
    pool_bytes: int
    kda_state_bytes_per_request: int
    mla_kv_bytes_per_token: int
    max_position_embeddings: int
    layout: PoolLayout
    sglang: SGLangSplit | None
    recommendation: Recommendation | None
    sglang_inputs: dict[str, Any] | None = None

    @property
    def kv_tokens_per_rank(self) -> int:
        return self.sglang.kv_tokens_per_rank if self.sglang else self.layout.kv_tokens_per_rank

    @property
    def kv_tokens_logical(self) -> int:
        return self.sglang.kv_tokens_logical if self.sglang else self.layout.kv_tokens_logical

    @property
    def state_slots(self) -> int:
        return self.sglang.state_slots if self.sglang else self.layout.state_slots

    @property
    def max_running_requests(self) -> int:
        """SGLang: its running-request cap. tidal: requests of the workload's length, or without a
        workload the state-bound cap (requests of one token each)."""
        if self.sglang:
            if self.workload:
                return self.sglang.max_requests(self.workload.context_len)
            return self.sglang.max_running_requests
        return self.layout.max_requests(self.workload.context_len if self.workload else 1)

    @property
    def max_context_len(self) -> int:
        """Longest single request: the pool's limit, capped at the model's max_position_embeddings."""
        pool = self.sglang.max_context_len() if self.sglang else self.layout.max_context_len()
        return min(pool, self.max_position_embeddings)


def plan(
    config: ModelConfig,
    *,
    gpu_memory_gib: float,
    tp_size: int = 1,
    dcp_size: int = 1,
    ep_size: int = 1,
    num_gpus: int | None = None,
    mem_fraction_static: float = 0.9,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    model: str = "model",
    a_log_values: int | None = None,
    **kw: Any,
) -> Plan:
    """Plan for a GPU spec: pool = gpu_memory * mem_fraction_static - weights - reserve."""
    if not 0 < mem_fraction_static <= 1:
        raise PlanError(f"--mem-fraction-static must be in (0, 1], got {mem_fraction_static}")
    if gpu_memory_gib <= 0:
        raise PlanError(f"--gpu-memory must be > 0 GiB, got {gpu_memory_gib}")
    par = Parallel(tp_size, dcp_size, ep_size, num_gpus)
    check_parallel(config, par)
    weights = weight_breakdown(config, tp_size=tp_size, ep_size=ep_size, a_log_values=a_log_values)
    gpu = int(gpu_memory_gib * GIB)
    static = int(gpu * mem_fraction_static)
    per_rank = sum(w.per_rank_bytes for w in weights)
    pool = static - per_rank - reserve_bytes
    if pool <= 0:
        raise PlanError(
            f"weights do not fit: {_gib(per_rank)} per rank, but {_gib(static - reserve_bytes)} is available "
            f"({gpu_memory_gib:g} GiB x mem_fraction_static {mem_fraction_static:g} - {_gib(reserve_bytes)} reserve); "
            f"short by {_gib(-pool)} before any KV or state. Use more GPUs or a larger --mem-fraction-static"
        )
    return _assemble(config, par, weights, per_rank, False, pool, gpu, mem_fraction_static, reserve_bytes, model, **kw)


def plan_for_pool(
    config: ModelConfig,
    pool_bytes: int,
    weights_bytes: int | None = None,
    *,
    tp_size: int = 1,
    dcp_size: int = 1,
    ep_size: int = 1,
    model: str = "model",
    dtype: Any = None,
    **kw: Any,
) -> Plan:
    """Plan for a pool measured on the device (engine start-up). weights_bytes: the measured weights
    per rank (None: the formula's); the per-kind breakdown is always the formula's. dtype: the
    running model's torch dtype (default: the config's), which sets the conv-state and default KV bytes."""
    if dtype is not None:
        kw.setdefault("kv_dtype", _DTYPE_NAMES[str(dtype).removeprefix("torch.")])
        kw.setdefault("conv_dtype_bytes", dtype.itemsize)
    par = Parallel(tp_size, dcp_size, ep_size)
    check_parallel(config, par)
    weights = weight_breakdown(config, tp_size=tp_size, ep_size=ep_size)
    measured = weights_bytes is not None
    per_rank = weights_bytes if measured else sum(w.per_rank_bytes for w in weights)
    return _assemble(config, par, weights, per_rank, measured, pool_bytes, None, None, 0, model, **kw)


def _assemble(
    config: ModelConfig,
    par: Parallel,
    weights: tuple[WeightShare, ...],
    weights_per_rank: int,
    measured: bool,
    pool_bytes: int,
    gpu_bytes: int | None,
    mem_fraction: float | None,
    reserve: int,
    model: str,
    *,
    kv_dtype: str = "bf16",
    page_size: int = DEFAULT_PAGE_SIZE,
    spec_draft_tokens: int = 0,
    workload: Workload | None = None,
    engine: str = "tidal",
    mamba_full_memory_ratio: float = SGLANG_DEFAULT_RATIO,
    slots_per_request: int = SGLANG_DEFAULT_SLOTS_PER_REQUEST,
    max_running_requests: int | None = None,
    conv_dtype_bytes: int | None = None,
) -> Plan:
    if kv_dtype not in KV_DTYPE_BYTES:
        raise PlanError(f"--kv-dtype must be one of {', '.join(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    if engine not in ("tidal", "sglang"):
        raise PlanError(f"--engine must be tidal or sglang, got {engine!r}")
    if spec_draft_tokens < 0:
        raise PlanError(f"--spec-draft-tokens must be >= 0, got {spec_draft_tokens}")
    if slots_per_request < 1:
        raise PlanError(f"SGLang slots per request must be >= 1, got {slots_per_request}")
    kv_b, conv_b = KV_DTYPE_BYTES[kv_dtype], conv_dtype_bytes or _dtype_bytes(config)
    common = dict(tp_size=par.tp_size, dcp_size=par.dcp_size, page_size=page_size, kv_dtype_bytes=kv_b,
                  conv_dtype_bytes=conv_b, spec_draft_tokens=spec_draft_tokens)
    layout = pool_layout(config, pool_bytes, **common)
    split_kw = dict(common, ratio=mamba_full_memory_ratio, slots_per_request=slots_per_request,
                    max_running_requests=max_running_requests)
    split = sglang_split(config, pool_bytes, **split_kw) if engine == "sglang" else None
    rec = recommend_ratio(config, pool_bytes, workload, layout, **split_kw) if workload else None
    sglang_inputs = None
    if engine == "sglang" or workload:
        sglang_inputs = dict(mamba_full_memory_ratio=mamba_full_memory_ratio, slots_per_request=slots_per_request,
                             max_running_requests=max_running_requests)
    return Plan(
        model=model,
        engine=engine,
        parallel=Parallel(par.tp_size, par.dcp_size, par.ep_size, par.num_gpus or par.tp_size),
        gpu_memory_bytes=gpu_bytes,
        mem_fraction_static=mem_fraction,
        reserve_bytes=reserve,
        kv_dtype=kv_dtype,
        page_size=page_size,
        spec_draft_tokens=spec_draft_tokens,
        workload=workload,
        weights=weights,
        weights_bytes_per_rank=weights_per_rank,
        weights_measured=measured,
        pool_bytes=pool_bytes,
        kda_state_bytes_per_request=layout.state_bytes,
        mla_kv_bytes_per_token=layout.page_bytes // page_size,
        max_position_embeddings=config.max_position_embeddings,
        layout=layout,
        sglang=split,
        recommendation=rec,
        sglang_inputs=sglang_inputs,
    )


# ---- output --------------------------------------------------------------------------------------


def plan_to_json(p: Plan) -> dict[str, Any]:
    """The stable interface scripts read: top-level numbers follow ``engine``; inputs are echoed."""
    lay = p.layout
    out: dict[str, Any] = {
        "model": p.model,
        "engine": p.engine,
        "inputs": {
            "gpu_memory_gib": p.gpu_memory_bytes / GIB if p.gpu_memory_bytes is not None else None,
            "num_gpus": p.parallel.num_gpus,
            "tp_size": p.parallel.tp_size,
            "dcp_size": p.parallel.dcp_size,
            "ep_size": p.parallel.ep_size,
            "mem_fraction_static": p.mem_fraction_static,
            "kv_dtype": p.kv_dtype,
            "page_size": p.page_size,
            "spec_draft_tokens": p.spec_draft_tokens,
            "reserve_bytes": p.reserve_bytes,
            "workload": asdict(p.workload) if p.workload else None,
            **(p.sglang_inputs or {}),
        },
        "weights_bytes_per_rank": p.weights_bytes_per_rank,
        "weights_measured": p.weights_measured,
        "weights_total_bytes": sum(w.total_bytes for w in p.weights),
        "weights_by_kind": {
            w.kind: {"per_rank_bytes": w.per_rank_bytes, "total_bytes": w.total_bytes, "sharding": w.sharding}
            for w in p.weights
        },
        "pool_bytes_per_rank": p.pool_bytes,
        "kda_state_bytes_per_request_per_rank": p.kda_state_bytes_per_request,
        "mla_kv_bytes_per_token_per_rank": p.mla_kv_bytes_per_token,
        "kv_tokens_per_rank": p.kv_tokens_per_rank,
        "kv_tokens_logical": p.kv_tokens_logical,
        "state_slots": p.state_slots,
        "max_running_requests": p.max_running_requests,
        "max_context_len": p.max_context_len,
        "tidal_pool": {
            "page_size": lay.page_size,
            "page_bytes": lay.page_bytes,
            "pages_per_block": lay.pages_per_block,
            "block_bytes": lay.block_bytes,
            "num_blocks": lay.num_blocks,
            "state_blocks_per_request": lay.state_blocks_per_request,
            "kv_tokens_per_rank": lay.kv_tokens_per_rank,
            "kv_tokens_logical": lay.kv_tokens_logical,
            "max_context_len": min(lay.max_context_len(), p.max_position_embeddings),
            "max_requests_for_workload": lay.max_requests(p.workload.context_len) if p.workload else None,
        },
        "sglang": _split_json(p.sglang),
        "recommendation": None,
    }
    if p.recommendation:
        r = p.recommendation
        out["recommendation"] = {
            "mamba_full_memory_ratio": r.ratio,
            "ratio_min": r.ratio_min,
            "ratio_max": r.ratio_max,
            "state_bytes_needed": r.state_bytes_needed,
            "kv_bytes_needed": r.kv_bytes_needed,
            "reason": r.reason,
            "sglang_at_ratio": _split_json(r.sglang),
            "tidal_max_requests": r.tidal_max_requests,
            "tidal_max_context_len": min(r.tidal_max_context_len, p.max_position_embeddings),
        }
    return out


def _split_json(s: SGLangSplit | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {**asdict(s), "kv_tokens_logical": s.kv_tokens_logical, "max_context_len": s.max_context_len()}


def _gib(b: float) -> str:
    """Bytes in GiB, or in MiB/KiB when GiB would round to zero (small models)."""
    if abs(b) >= GIB / 100 or b == 0:
        return f"{b / GIB:,.2f} GiB"
    if abs(b) >= MIB / 100:
        return f"{b / MIB:,.2f} MiB"
    return f"{b / 1024:,.2f} KiB"


def _mib(b: float) -> str:
    return f"{b / MIB:,.2f} MiB"


def plan_table(p: Plan, width: int = 100) -> str:
    """The plan as rich tables, rendered to plain text."""
    import io

    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)
    par = p.parallel
    head = (
        f"tidal plan: {p.model} | {par.num_gpus} GPU(s), TP {par.tp_size}, DCP {par.dcp_size}, EP {par.ep_size} | "
        f"KV {p.kv_dtype}, page {p.page_size}" + (f", {p.spec_draft_tokens} draft tokens" if p.spec_draft_tokens else "")
    )
    console.print(head)

    w = Table(title="weights per rank")
    for col in ("kind", "sharding", "per rank", "whole model"):
        w.add_column(col, justify="left" if col in ("kind", "sharding") else "right")
    for s in p.weights:
        w.add_row(s.kind, s.sharding, _gib(s.per_rank_bytes), _gib(s.total_bytes))
    w.add_row("total", "measured" if p.weights_measured else "formula", _gib(p.weights_bytes_per_rank),
              _gib(sum(s.total_bytes for s in p.weights)))
    console.print(w)

    m = Table(title="memory per rank")
    m.add_column("item")
    m.add_column("value", justify="right")
    if p.gpu_memory_bytes is not None:
        static = p.gpu_memory_bytes * p.mem_fraction_static
        m.add_row(f"GPU x mem_fraction_static {p.mem_fraction_static:g}", _gib(static))
        m.add_row("- weights", _gib(p.weights_bytes_per_rank))
        m.add_row("- workspace reserve", _gib(p.reserve_bytes))
    m.add_row("= pool (state + KV)", _gib(p.pool_bytes))
    m.add_row("KDA state per request", f"{_mib(p.kda_state_bytes_per_request)} ({p.kda_state_bytes_per_request:,} B)")
    m.add_row("MLA KV per stored token", f"{p.mla_kv_bytes_per_token:,} B")
    console.print(m)

    lay = p.layout
    t = Table(title="tidal single pool" + (" (same memory)" if p.engine == "sglang" else ""))
    t.add_column("item")
    t.add_column("value", justify="right")
    block = f"{lay.pages_per_block} pages of {lay.page_size} tokens, {_mib(lay.block_bytes)}"
    t.add_row("block = one request's state", block)
    t.add_row("blocks (= state slots)", f"{lay.num_blocks:,}")
    t.add_row("KV tokens per rank (pool all KV)", f"{lay.kv_tokens_per_rank:,}")
    t.add_row(f"KV tokens logical (DCP {lay.dcp_size})", f"{lay.kv_tokens_logical:,}")
    t.add_row("longest single context", f"{min(lay.max_context_len(), p.max_position_embeddings):,}")
    if p.workload:
        t.add_row(f"requests of {p.workload.context_len:,} tokens", f"{lay.max_requests(p.workload.context_len):,}")
    else:
        t.add_row("max running requests (1-token contexts)", f"{lay.max_requests(1):,}")
    console.print(t)

    if p.sglang:
        console.print(_split_table(p.sglang, f"SGLang split, R = {p.sglang.ratio:g}", p.workload))
    r = p.recommendation
    if r:
        wl = r.workload
        line = f"workload isl={wl.isl} osl={wl.osl} concurrency={wl.concurrency}: "
        if r.ratio is not None:
            line += f"SGLang needs --mamba-full-memory-ratio {r.ratio:g} ({r.reason})"
        else:
            line += f"SGLang cannot serve it: {r.reason}"
        line += f"; tidal's pool runs {r.tidal_max_requests:,} such requests"
        console.print(line)
        if r.sglang is not None and (p.sglang is None or r.sglang.ratio != p.sglang.ratio):
            console.print(_split_table(r.sglang, f"SGLang split at recommended R = {r.ratio:g}", wl))
    return console.file.getvalue()


def _split_table(s: SGLangSplit, title: str, workload: Workload | None):
    from rich.table import Table

    t = Table(title=title)
    t.add_column("step")
    t.add_column("value", justify="right")
    t.add_row("1 rest after weights", _gib(s.rest_bytes))
    t.add_row("3 state budget rest*R/(1+R)", _gib(s.state_budget_bytes))
    t.add_row("3 state slots", f"{s.state_slots:,}")
    if s.spec_draft_tokens:
        t.add_row("4 speculative scratch", _gib(s.spec_scratch_bytes))
    t.add_row("5 KV tokens per rank", f"{s.kv_tokens_per_rank:,}")
    t.add_row(f"5 KV tokens logical (DCP {s.dcp_size})", f"{s.kv_tokens_logical:,}")
    t.add_row(f"6 max running requests ({s.slots_per_request} slots each)", f"{s.max_running_requests:,}")
    if workload:
        t.add_row(f"requests of {workload.context_len:,} tokens", f"{s.max_requests(workload.context_len):,}")
    return t


# ---- command line --------------------------------------------------------------------------------


def load_model(spec: str) -> tuple[str, ModelConfig, int | None]:
    """PRESET, config.json or model directory -> (name, config, on-disk A_log count if known)."""
    from tidal.presets import PRESET_FILES, preset

    if spec in PRESET_FILES:
        return spec, preset(spec), PUBLISHED_A_LOG_VALUES.get(spec)
    path = Path(spec)
    if not path.exists():
        raise PlanError(f"--model {spec!r} is neither a preset ({', '.join(PRESET_FILES)}) nor a path")
    return path.name if path.is_dir() else str(path), ModelConfig.from_file(path), None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tidal plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="preset (kimi-k3, kimi-linear-48b), config.json or model dir")
    ap.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="memory of one GPU in GiB")
    ap.add_argument("--num-gpus", type=int, default=None, help="GPUs (must equal --tp-size; default: --tp-size)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--dcp-size", type=int, default=1, help="decode context parallel size (divides --tp-size)")
    ap.add_argument("--ep-size", type=int, default=1, help="expert parallel size (divides --tp-size)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.9)
    ap.add_argument("--reserve-gib", type=float, default=DEFAULT_RESERVE_BYTES / GIB,
                    help="workspace kept out of the pool inside the static fraction")
    ap.add_argument("--kv-dtype", choices=tuple(KV_DTYPE_BYTES), default="bf16")
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    ap.add_argument("--spec-draft-tokens", type=int, default=0, metavar="K")
    ap.add_argument("--workload", default=None, help='"isl=8192,osl=1024,concurrency=50"')
    ap.add_argument("--engine", choices=("tidal", "sglang"), default="tidal")
    ap.add_argument("--mamba-full-memory-ratio", type=float, default=SGLANG_DEFAULT_RATIO, metavar="R")
    ap.add_argument("--sglang-slots-per-request", type=int, default=SGLANG_DEFAULT_SLOTS_PER_REQUEST,
                    help="1: radix cache off; 3: default; 5: extra_buffer with overlap")
    ap.add_argument("--max-running-requests", type=int, default=None, help="SGLang's cap (default: its own rule)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        name, config, a_log = load_model(args.model)
        p = plan(
            config,
            gpu_memory_gib=args.gpu_memory,
            tp_size=args.tp_size,
            dcp_size=args.dcp_size,
            ep_size=args.ep_size,
            num_gpus=args.num_gpus,
            mem_fraction_static=args.mem_fraction_static,
            reserve_bytes=int(args.reserve_gib * GIB),
            model=name,
            a_log_values=a_log,
            kv_dtype=args.kv_dtype,
            page_size=args.page_size,
            spec_draft_tokens=args.spec_draft_tokens,
            workload=Workload.parse(args.workload) if args.workload else None,
            engine=args.engine,
            mamba_full_memory_ratio=args.mamba_full_memory_ratio,
            slots_per_request=args.sglang_slots_per_request,
            max_running_requests=args.max_running_requests,
        )
    except (PlanError, ConfigError) as e:
        if args.json:
            print(json.dumps({"error": str(e)}))
        print(f"tidal plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_to_json(p), indent=2) if args.json else plan_table(p), end="" if not args.json else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
