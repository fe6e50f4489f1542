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

from tidal.plan.cli import build_parser, load_model, main
from tidal.plan.layout import (
    DEFAULT_PAGE_SIZE,
    DEFAULT_RESERVE_BYTES,
    FP32,
    GIB,
    KV_DTYPE_BYTES,
    MIB,
    PUBLISHED_A_LOG_VALUES,
    SGLANG_DEFAULT_RATIO,
    SGLANG_DEFAULT_SLOTS_PER_REQUEST,
    SNAPSHOT_KV_FRACTION,
    PlanError,
    PoolLayout,
    kda_state_bytes_per_request,
    mla_kv_bytes_per_token,
    pool_layout,
    prefix_snapshot_interval,
)
from tidal.plan.planner import Plan, plan, plan_for_pool
from tidal.plan.report import plan_table, plan_to_json
from tidal.plan.sglang import (
    Parallel,
    Recommendation,
    SGLangSplit,
    Workload,
    check_parallel,
    recommend_ratio,
    sglang_split,
)
from tidal.plan.weights import (
    WEIGHT_KINDS,
    WeightShare,
    mxfp4_bytes,
    weight_breakdown,
    weight_bytes,
)

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_RESERVE_BYTES",
    "FP32",
    "GIB",
    "KV_DTYPE_BYTES",
    "MIB",
    "PUBLISHED_A_LOG_VALUES",
    "Parallel",
    "Plan",
    "PlanError",
    "PoolLayout",
    "Recommendation",
    "SGLANG_DEFAULT_RATIO",
    "SGLANG_DEFAULT_SLOTS_PER_REQUEST",
    "SGLangSplit",
    "SNAPSHOT_KV_FRACTION",
    "WEIGHT_KINDS",
    "WeightShare",
    "Workload",
    "build_parser",
    "check_parallel",
    "kda_state_bytes_per_request",
    "load_model",
    "main",
    "mla_kv_bytes_per_token",
    "mxfp4_bytes",
    "plan",
    "plan_for_pool",
    "plan_table",
    "plan_to_json",
    "pool_layout",
    "prefix_snapshot_interval",
    "recommend_ratio",
    "sglang_split",
    "weight_breakdown",
    "weight_bytes",
]
