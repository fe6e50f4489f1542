"""``GET /metrics``: Prometheus text, named as vLLM names its metrics (prefix ``tidal:``, label
``model_name``), and the families vLLM's Grafana dashboard reads once more under ``vllm:``, so
dashboards and bench scrapers built for vLLM read tidal unchanged.

Gauges and engine counters are read from the engine client's stats at scrape time; the per-request
histograms are observed when a request ends (from the engine core's finished-request records).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tidal.serve.engine_client import EngineStats
from tidal.serve.wire import FinishedRequest

PREFIX = "tidal:"
VLLM_PREFIX = "vllm:"
# The families vLLM's Grafana dashboard reads, exported again under vLLM's own prefix.
VLLM_ALIASES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens", "generation_tokens",
    "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "request_success",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
    "request_generation_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
})

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = tuple(float(2**b) for b in range(21))


# (name, help, value from EngineStats): gauges are read now, counters are cumulative engine counters.
GAUGES: list[tuple[str, str, Callable[[EngineStats], float]]] = [
    ("num_requests_running", "Requests in the running batch.", lambda s: s.metrics.num_running),
    ("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.metrics.num_waiting),
    ("kv_cache_usage_perc", ("Fraction of the memory pool (KV pages and KDA state) held by requests; evictable "
                             "prefix-cache memory counts as free (1 = full)."), lambda s: s.held_usage),
    ("pool_usage_perc", "Fraction of the memory pool in use, prefix cache included.", lambda s: s.metrics.pool_usage),
    ("prefix_cache_pages", "KV pages only the prefix cache holds (evictable).",
     lambda s: s.metrics.prefix_cache_pages),
    ("prefix_cache_snapshots", "KDA state snapshots the prefix cache holds (a block each).",
     lambda s: s.metrics.prefix_cache_snapshots),
    ("pool_free_pages", "Free pages in the memory pool.", lambda s: s.metrics.pool_free_pages),
    ("pool_total_pages", "Pages in the memory pool.", lambda s: s.metrics.pool_total_pages),
]
COUNTERS: list[tuple[str, str, Callable[[EngineStats], float]]] = [
    ("prompt_tokens", "Prompt tokens of admitted requests.", lambda s: s.metrics.prompt_tokens),
    ("generation_tokens", "Generated tokens.", lambda s: s.metrics.generation_tokens),
    ("num_preemptions", "Requests preempted (recomputed later) for lack of memory.",
     lambda s: s.metrics.num_preemptions),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda s: s.metrics.prefix_cache_queries),
    ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", lambda s: s.metrics.prefix_cache_hits),
    ("recomputed_tokens", "Tokens prefilled again after a preemption.", lambda s: s.metrics.recomputed_tokens),
    ("num_requests_aborted", "Requests aborted (client gone, shutdown).", lambda s: s.metrics.num_requests_aborted),
    ("num_requests_rejected", "Requests rejected when added (too long, invalid).",
     lambda s: s.metrics.num_requests_rejected),
    ("engine_steps", "Engine steps run.", lambda s: s.metrics.num_steps),
    ("spec_decode_num_drafts", "Speculative chains verified.", lambda s: s.metrics.spec_num_chains),
    ("spec_decode_num_draft_tokens", "Drafted tokens verified.", lambda s: s.metrics.spec_num_draft_tokens),
    ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", lambda s: s.metrics.spec_num_accepted_tokens),
]


class _EngineCollector(Collector):
    """Gauges and cumulative counters straight from the engine's counters."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for family, table in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for name, doc, value in table:
                metric = family(PREFIX + name, doc, labels=["model_name"])
                metric.add_metric([self.model_name], value(stats))
                yield metric
        m = stats.metrics
        labelled = [  # (name, help, label, {label value: count})
            ("spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, by position in the chain "
             "(0: the first draft).", "position", dict(enumerate(m.spec_position_accepted))),
            ("spec_decode_num_draft_tokens_per_pos", "Drafted tokens verified, by position in the chain.",
             "position", dict(enumerate(m.spec_position_drafted))),
            ("spec_decode_accept_length", "Chains by committed tokens (accepted drafts + the target's token).",
             "length", {n: c for n, c in enumerate(m.spec_accept_length_counts) if n}),
        ]
        for name, doc, label, values in labelled:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", label])
            for key, count in values.items():
                family.add_metric([self.model_name, str(key)], count)
            yield family


class _VllmAliases(Collector):
    """The ``tidal:`` families of ``source`` that vLLM also has, renamed ``vllm:`` (samples and all)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            short = family.name.removeprefix(PREFIX)
            if short not in VLLM_ALIASES:
                continue
            alias = Metric(VLLM_PREFIX + short, family.documentation, family.type)
            alias.samples = [s._replace(name=VLLM_PREFIX + s.name.removeprefix(PREFIX)) for s in family.samples]
            yield alias


class ServerMetrics:
    """The registry behind ``/metrics``; :meth:`observe` is the engine client's ``on_finished``."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(model_name, stats))
        lab = ["model_name"]
        self.request_success = Counter(PREFIX + "request_success", "Requests that ended, by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first generated token.", lab,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens.", lab,
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (output tokens - 1).", lab,
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the request's end.", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.", lab,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per request.", lab,
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram(PREFIX + "request_generation_tokens", "Output tokens per request.", lab,
                                           buckets=TOKEN_BUCKETS, registry=r)

    def observe(self, out: FinishedRequest) -> None:
        name = self.model_name
        self.request_success.labels(name, out.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(name).observe(out.num_prompt_tokens)
        self.generation_tokens.labels(name).observe(out.num_output_tokens)
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.labels(name).observe(m.ttft)
        itl = self.itl.labels(name)
        for gap in m.inter_token_times:
            itl.observe(gap)
        if m.inter_token_times:
            self.tpot.labels(name).observe(sum(m.inter_token_times) / len(m.inter_token_times))
        if m.e2e_latency is not None:
            self.e2e.labels(name).observe(m.e2e_latency)
        if m.queue_time is not None:
            self.queue.labels(name).observe(m.queue_time)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for the scrape: tidal's families, then their vLLM-named aliases."""
        aliases = CollectorRegistry()
        aliases.register(_VllmAliases(self.registry))
        return generate_latest(self.registry) + generate_latest(aliases), CONTENT_TYPE_LATEST
