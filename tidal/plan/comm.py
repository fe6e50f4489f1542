"""What one rank hands to collectives per decode step, by layer type: the planner's estimate of
what ``tidal.parallel`` issues.

Tensor parallel (``tidal.parallel.layers``): one all-reduce of the sub-layer's output per attention
(KDA or MLA), dense MLP and MoE; a latent MoE reduces its routed sum at the latent width before the
norm, and its shared experts' output separately; the embedding's vocabulary shards are summed (an
all-reduce) and lm_head's logits gathered. Decode context parallel (``tidal.parallel.dcp``), per MLA
layer: the absorbed queries gathered, the log-sum-exps gathered, the rescaled parts summed (an
all-reduce standing in for a reduce-scatter). Expert parallel adds nothing: each EP group's ranks
compute their experts' share of every token and the MoE all-reduce sums it.

Two figures per collective: ``payload``, the bytes of the tensor a rank passes in (what a counter
around the collective sees), and ``wire``, what a ring algorithm sends per rank: 2 (N-1)/N x the
payload for an all-reduce, (N-1) x it for an all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config import ModelConfig

ALL_REDUCE, ALL_GATHER = "all_reduce", "all_gather"


@dataclass(frozen=True)
class Collective:
    layer_type: str  # embedding, kda, mla, mla_dcp, dense_mlp, moe, lm_head
    op: str
    group_size: int
    payload_bytes: int

    @property
    def wire_bytes(self) -> float:
        n = self.group_size
        return self.payload_bytes * (2 * (n - 1) / n if self.op == ALL_REDUCE else n - 1)


def decode_collectives(
    config: ModelConfig, *, tp_size: int, dcp_size: int = 1, batch_size: int = 1, dtype_bytes: int = 2,
    compute_bytes: int = 4,
) -> list[Collective]:
    """Every collective of one decode step of ``batch_size`` sequences (one token each), on one
    rank, in order. ``dtype_bytes``: the model's activations; ``compute_bytes``: the float32 DCP
    partials (queries, log-sum-exps, rescaled outputs)."""
    if tp_size == 1:
        return []
    B, d = batch_size, config.hidden_size
    out = [Collective("embedding", ALL_REDUCE, tp_size, B * d * dtype_bytes)]
    heads = config.num_attention_heads // tp_size  # this rank's MLA heads
    for layer in range(config.num_hidden_layers):
        if config.is_kda_layer(layer):
            out.append(Collective("kda", ALL_REDUCE, tp_size, B * d * dtype_bytes))
        else:
            if dcp_size > 1:
                r = config.kv_lora_rank
                group_heads = heads * dcp_size
                out += [
                    Collective("mla_dcp", ALL_GATHER, dcp_size, B * heads * (r + config.qk_rope_head_dim) * compute_bytes),
                    Collective("mla_dcp", ALL_GATHER, dcp_size, B * group_heads * compute_bytes),
                    Collective("mla_dcp", ALL_REDUCE, dcp_size, B * group_heads * r * compute_bytes),
                ]
            out.append(Collective("mla", ALL_REDUCE, tp_size, B * d * dtype_bytes))
        if not config.is_moe_layer(layer):
            out.append(Collective("dense_mlp", ALL_REDUCE, tp_size, B * d * dtype_bytes))
        elif config.is_latent_moe:
            out.append(Collective("moe", ALL_REDUCE, tp_size, B * config.expert_hidden_size * dtype_bytes))
            if config.num_shared_experts:
                out.append(Collective("moe", ALL_REDUCE, tp_size, B * d * dtype_bytes))
        else:
            out.append(Collective("moe", ALL_REDUCE, tp_size, B * d * dtype_bytes))
    rows = -(-config.vocab_size // tp_size)
    out.append(Collective("lm_head", ALL_GATHER, tp_size, B * rows * dtype_bytes))
    return out


def decode_bytes_by_layer_type(collectives: list[Collective]) -> dict[str, tuple[int, float]]:
    """(payload, wire) bytes per layer type."""
    table: dict[str, tuple[int, float]] = {}
    for c in collectives:
        p, w = table.get(c.layer_type, (0, 0.0))
        table[c.layer_type] = (p + c.payload_bytes, w + c.wire_bytes)
    return table
