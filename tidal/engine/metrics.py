"""Engine and per-request metrics, plain data the server exports (Prometheus names come later)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()`` seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    inter_token_times: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        """Arrival until first scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Arrival until the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def on_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            self.inter_token_times.append(now - self.last_token_time)
        self.last_token_time = now


@dataclass
class EngineMetrics:
    """Engine-wide gauges (now) and counters (since start)."""

    num_running: int = 0
    num_waiting: int = 0
    pool_usage: float = 0.0  # fraction of the pool's page units held
    pool_free_pages: int = 0
    pool_total_pages: int = 0
    pool_state_blocks: int = 0
    pool_kv_blocks: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_compactions: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests, counted once
    recomputed_tokens: int = 0  # tokens prefilled again after a preemption
    generation_tokens: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_requests_rejected: int = 0
    # Prefix cache (all 0 when it is disabled).
    prefix_cache_queries: int = 0  # prompt tokens looked up, once per request
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    prefix_cache_snapshots: int = 0  # KDA state snapshots held now (one pool block each)
    prefix_cache_pages: int = 0  # KV pages only the cache holds now (evictable)
    prefix_cache_evicted_snapshots: int = 0
    # Speculative decoding (all 0 / empty when off; tidal.spec.metrics.SpecMetrics). A chain's
    # accept length counts its committed tokens: accepted drafts + the token the target adds.
    spec_num_chains: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accept_length_counts: list[int] = field(default_factory=list)  # [n]: chains committing n
    spec_position_drafted: list[int] = field(default_factory=list)  # [i]: chains that drafted token i+1
    spec_position_accepted: list[int] = field(default_factory=list)  # [i]: ... and accepted it

    @property
    def avg_spec_accept_length(self) -> float | None:
        """Committed tokens per verified chain (SGLang's avg_spec_accept_length); None before any."""
        if not self.spec_num_chains:
            return None
        return sum(n * c for n, c in enumerate(self.spec_accept_length_counts)) / self.spec_num_chains

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens (0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
