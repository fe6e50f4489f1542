"""The plan: weights, pool and capacities for a GPU spec or for a pool measured at engine start-up."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tidal.config import ModelConfig
from tidal.plan.layout import (
    _DTYPE_NAMES,
    DEFAULT_PAGE_SIZE,
    DEFAULT_RESERVE_BYTES,
    GIB,
    KV_DTYPE_BYTES,
    SGLANG_DEFAULT_RATIO,
    SGLANG_DEFAULT_SLOTS_PER_REQUEST,
    PlanError,
    PoolLayout,
    _gib,
    pool_layout,
    prefix_snapshot_interval,
)
from tidal.plan.sglang import (
    Parallel,
    Recommendation,
    SGLangSplit,
    Workload,
    check_parallel,
    recommend_ratio,
    sglang_split,
)
from tidal.plan.comm import decode_bytes_by_layer_type, decode_collectives
from tidal.plan.weights import WeightShare, _dtype_bytes, weight_breakdown

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
    prefix_snapshot_interval: int  # derived from the two above (layout.prefix_snapshot_interval)
    max_position_embeddings: int
    layout: PoolLayout
    sglang: SGLangSplit | None
    recommendation: Recommendation | None
    sglang_inputs: dict[str, Any] | None = None
    running_cap: int | None = None  # --max-running-requests: tidal's and SGLang's cap on the running set
    device: str | None = None  # the device a measured pool lives on (None: tidal plan's GPU arithmetic)
    # layer type -> (payload, ring wire) bytes one rank hands to collectives per decode step, per
    # sequence in the step (tidal.plan.comm; a step of B sequences is B times this); empty at TP 1
    decode_comm: dict[str, tuple[int, float]] = field(default_factory=dict)

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
        workload the state-bound cap (requests of one token each), at most --max-running-requests."""
        if self.sglang:
            if self.workload:
                return self.sglang.max_requests(self.workload.context_len)
            return self.sglang.max_running_requests
        fit = self.layout.max_requests(self.workload.context_len if self.workload else 1)
        return fit if self.running_cap is None else min(fit, self.running_cap)

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
            f"short by {_gib(-pool)} before any KV or state. {_what_fits(config, static - reserve_bytes, tp_size, ep_size, a_log_values)}"
        )
    return _assemble(config, par, weights, per_rank, False, pool, gpu, mem_fraction_static, reserve_bytes, model, **kw)


def _what_fits(config: ModelConfig, room: int, tp_size: int, ep_size: int, a_log_values: int | None) -> str:
    """Advice that names a layout whose weights fit in ``room`` bytes per GPU: a higher EP on the
    same GPUs first, else the fewest more GPUs (TP, with the smallest EP that fits), up to 64."""
    tp = tp_size
    while tp <= 64:
        ep = ep_size * 2 if tp == tp_size else 1
        while ep <= tp:
            try:
                check_parallel(config, Parallel(tp, 1, ep, tp))
                need = sum(w.per_rank_bytes for w in weight_breakdown(config, tp_size=tp, ep_size=ep,
                                                                       a_log_values=a_log_values))
            except PlanError:
                need = None
            if need is not None and need < room:
                return (f"This fits: --num-gpus {tp} --tp-size {tp} --ep-size {ep} "
                        f"({_gib(need)} of weights per rank)")
            ep *= 2
        tp *= 2
    return "The weights do not fit on up to 64 GPUs of this size: use GPUs with more memory"


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
    device: str | None = None,
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
    p = _assemble(config, par, weights, per_rank, measured, pool_bytes, None, None, 0, model, **kw)
    return replace(p, device=device)


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
        prefix_snapshot_interval=prefix_snapshot_interval(layout.state_bytes, layout.page_bytes // page_size, page_size),
        max_position_embeddings=config.max_position_embeddings,
        layout=layout,
        sglang=split,
        recommendation=rec,
        sglang_inputs=sglang_inputs,
        running_cap=max_running_requests,
        decode_comm=decode_bytes_by_layer_type(decode_collectives(
            config, tp_size=par.tp_size, dcp_size=par.dcp_size, batch_size=1, dtype_bytes=conv_b)),  # model dtype
    )
