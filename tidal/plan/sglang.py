"""The workload, SGLang's ratio split (--mamba-full-memory-ratio) and the ratio a workload needs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tidal.config import ModelConfig
from tidal.plan.layout import (
    DEFAULT_PAGE_SIZE,
    SGLANG_DEFAULT_RATIO,
    SGLANG_DEFAULT_SLOTS_PER_REQUEST,
    PlanError,
    PoolLayout,
    _gib,
    kda_state_bytes_per_request,
    mla_kv_bytes_per_token,
)

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
