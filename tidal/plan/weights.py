"""Weight bytes by kind, whole model and per rank, as TP/EP shard them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.config import ModelConfig, parse_dtype
from tidal.plan.layout import FP32

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
