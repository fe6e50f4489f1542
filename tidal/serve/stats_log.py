"""The periodic stats line (vLLM's "Avg prompt throughput … Running … Waiting …"): every
``interval`` seconds while the server has work or just had some, throughput since the last line
from the engine's counters, the queue, pool usage and the prefix-cache hit rate."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tidal.serve.engine_client import EngineStats

logger = logging.getLogger("tidal.serve")


def stats_line(prev: EngineStats, now: EngineStats, seconds: float) -> str:
    a, b = prev.metrics, now.metrics
    queries = b.prefix_cache_queries - a.prefix_cache_queries
    hits = b.prefix_cache_hits - a.prefix_cache_hits
    return (f"Avg prompt throughput: {(b.prompt_tokens - a.prompt_tokens) / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {(b.generation_tokens - a.generation_tokens) / seconds:.1f} tokens/s, "
            f"Running: {b.num_running} reqs, Waiting: {b.num_waiting} reqs, "
            f"Pool usage: {100 * now.held_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")


async def log_stats(stats: Callable[[], EngineStats], interval: float) -> None:
    """Run until cancelled; a line only when something ran since the last one (an idle server is quiet)."""
    prev, t0 = stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now, t1 = stats(), time.monotonic()
        a, b = prev.metrics, now.metrics
        if b.num_steps != a.num_steps or b.num_running or b.num_waiting:
            logger.info("%s", stats_line(prev, now, max(t1 - t0, 1e-9)))
        prev, t0 = now, t1
