"""Cache sizes per request and per token, and tidal's single-pool layout (shared with the engine)."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config import ModelConfig

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


def _gib(b: float) -> str:
    """Bytes in GiB, or in MiB/KiB when GiB would round to zero (small models)."""
    if abs(b) >= GIB / 100 or b == 0:
        return f"{b / GIB:,.2f} GiB"
    if abs(b) >= MIB / 100:
        return f"{b / MIB:,.2f} MiB"
    return f"{b / 1024:,.2f} KiB"


def _mib(b: float) -> str:
    return f"{b / MIB:,.2f} MiB"


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


# ---- prefix-cache snapshots ----------------------------------------------------------------------

# A prefill snapshots its KDA state once the MLA KV it wrote since the last snapshot is worth this
# fraction of one state block: the snapshots of a cached prefix then never take more of the pool
# (nor more copy traffic) than the prefix's own KV.
SNAPSHOT_KV_FRACTION = 1.0


def prefix_snapshot_interval(
    state_bytes: int, kv_bytes_per_token: int, page_size: int, fraction: float = SNAPSHOT_KV_FRACTION
) -> int:
    """Prefill tokens between KDA state snapshots: the fewest whole pages whose KV is worth
    ``fraction`` x ``state_bytes`` (0 -- only at prompt and request ends -- for a model without MLA)."""
    if kv_bytes_per_token <= 0:
        return 0
    page_kv = kv_bytes_per_token * page_size
    pages = max(1, -(-int(fraction * state_bytes) // page_kv))
    return pages * page_size


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
