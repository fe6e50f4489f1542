"""Per-request and per-row metrics from recorded streams.

Definitions (times from the moment the request was sent):
- TTFT: first chunk carrying a token of any kind (reasoning, content or tool call). Role-only,
  usage-only and other empty chunks never count (SGLang's rule, not vLLM's any-chunk rule).
- TTFC: first chunk carrying answer output (content or tool call), i.e. after any reasoning.
- ITL: the gaps between consecutive token chunks, so the ITLs sum to last - first. By default one
  value per chunk (``itl="chunk"``), the rule of SGLang's and vLLM's clients on the OpenAI
  endpoints: a chunk that carries n tokens (text the server held back while it could still be a
  marker) counts as one long gap. ``itl="token"`` spreads each gap evenly over the chunk's n tokens
  instead (SGLang's rule on its native ``/generate``), one value per token; TPOT is per token in both.
- E2E: the last line received (including ``[DONE]``). TPOT: (E2E - TTFT) / (output - 1).
- Token counts per chunk: exact when the server says (logprobs / token_ids); otherwise
  ``usage.completion_tokens`` apportioned over the token chunks (one each when they match,
  else by a local tokenizer's per-chunk counts or by characters), at least one per chunk.
- Failed requests contribute to ``failed`` and ``error_classes`` only: no latency, no tokens.
Aggregates use SGLang bench_serving's key names; percentiles interpolate linearly (np.percentile).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tidal.bench.records import Chunk, RequestRecord

ChunkCounter = Callable[[Sequence[str]], list[int]]
ItlRule = Literal["chunk", "token"]
STAT_NAMES = ("ttft", "ttfc", "tpot", "itl", "e2e_latency")


@dataclass
class RequestMetrics:
    ttft: float
    ttfc: float | None
    e2e: float
    tpot: float | None
    input_tokens: int
    output_tokens: int
    cached_tokens: int | None
    itl: list[float] = field(default_factory=list)
    token_times: list[tuple[float, int]] = field(default_factory=list)   # (s since send, tokens)


def spread_counts(total: int, weights: Sequence[float]) -> list[int]:
    """Apportion ``total`` tokens over chunks in proportion to ``weights`` (largest remainder),
    giving every chunk at least one token."""
    n = len(weights)
    if n == 0:
        return []
    if total <= n:
        return [1] * n
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        w = np.ones(n)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    for i in np.flatnonzero(counts == 0):
        counts[int(np.argmax(counts))] -= 1
        counts[i] = 1
    return counts.tolist()


def chunk_token_counts(chunks: Sequence[Chunk], completion_tokens: int | None,
                       counter: ChunkCounter | None = None) -> list[int]:
    """Tokens carried by each token chunk (see the module docstring for the rule)."""
    if all(c.n_tokens is not None for c in chunks):
        return [max(int(c.n_tokens), 1) for c in chunks]
    n = len(chunks)
    if completion_tokens == n or (completion_tokens is None and counter is None):
        return [1] * n
    if counter is not None:
        weights = counter([c.text for c in chunks])
    else:
        weights = [len(c.text) for c in chunks]
    total = completion_tokens if completion_tokens is not None else int(sum(weights))
    return spread_counts(total, weights)


def request_metrics(rec: RequestRecord, counter: ChunkCounter | None = None,
                    itl_rule: ItlRule = "chunk") -> RequestMetrics | None:
    """Latencies and token counts of one successful request; None for a failed one."""
    if not rec.ok:
        return None
    tok = [c for c in rec.chunks if c.has_token]
    if not tok:
        return None
    counts = chunk_token_counts(tok, rec.completion_tokens, counter)
    itl: list[float] = []
    for prev, cur, n in zip(tok, tok[1:], counts[1:]):
        if itl_rule == "token":
            itl.extend([(cur.t - prev.t) / n] * n)
        else:
            itl.append(cur.t - prev.t)
    ttft = tok[0].t
    ttfc = next((c.t for c in tok if c.has_answer), None)
    out = rec.completion_tokens if rec.completion_tokens is not None else sum(counts)
    tpot = (rec.end - ttft) / (out - 1) if out > 1 else None
    return RequestMetrics(ttft=ttft, ttfc=ttfc, e2e=rec.end, tpot=tpot,
                          input_tokens=rec.prompt_tokens if rec.prompt_tokens is not None else rec.input_len,
                          output_tokens=out, cached_tokens=rec.cached_tokens, itl=itl,
                          token_times=[(c.t, n) for c, n in zip(tok, counts)])


def add_stats(out: dict, name: str, values_s: Sequence[float]) -> None:
    """mean/median/std/p90/p95/p99/max of ``values_s`` (seconds) as ``{stat}_{name}_ms``."""
    keys = ("mean", "median", "std", "p90", "p95", "p99", "max")
    if len(values_s) == 0:
        out.update({f"{k}_{name}_ms": None for k in keys})
        return
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    vals = (a.mean(), np.median(a), a.std(), *np.percentile(a, [90, 95, 99]), a.max())
    out.update({f"{k}_{name}_ms": float(v) for k, v in zip(keys, vals)})


def max_concurrent(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (sweep line; an end at the same instant as a start goes first)."""
    events = sorted([(r.send_time, 1) for r in records] + [(r.send_time + r.end, -1) for r in records])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def summarize(records: Sequence[RequestRecord], duration: float, *, cut: int = 0, row_start: float | None = None,
              counter: ChunkCounter | None = None, details: bool = False, itl_rule: ItlRule = "chunk") -> dict:
    """One row of the report. ``duration``: seconds from the first dispatch until the last
    measured request ended (or the deadline); ``cut``: requests cancelled at the deadline."""
    pairs = [(r, request_metrics(r, counter, itl_rule)) for r in records]
    done = [(r, m) for r, m in pairs if m is not None]
    failed = [r for r, m in pairs if m is None]
    # A 200 stream without a token chunk fails even when whoever recorded it did not say so.
    classes = [r.error_class or "empty_stream" for r in failed]
    ms = [m for _, m in done]
    dur = max(duration, 1e-9)
    n_in = sum(m.input_tokens for m in ms)
    n_out = sum(m.output_tokens for m in ms)
    cached = [(m.cached_tokens, m.input_tokens) for m in ms if m.cached_tokens is not None]
    row: dict = {
        "duration": duration, "completed": len(ms), "failed": len(failed), "cut": cut,
        "error_classes": dict(Counter(classes)),
        "error_examples": {c: next(r.error for r, k in zip(failed, classes) if k == c) for c in dict.fromkeys(classes)},
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "total_cached_tokens": sum(c for c, _ in cached) if cached else None,
        "cache_hit_rate": sum(c for c, _ in cached) / max(sum(i for _, i in cached), 1) if cached else None,
        "request_throughput": len(ms) / dur, "input_throughput": n_in / dur,
        "output_throughput": n_out / dur, "total_throughput": (n_in + n_out) / dur,
    }
    add_stats(row, "ttft", [m.ttft for m in ms])
    add_stats(row, "ttfc", [m.ttfc for m in ms if m.ttfc is not None])
    add_stats(row, "tpot", [m.tpot for m in ms if m.tpot is not None])
    add_stats(row, "itl", [x for m in ms for x in m.itl])
    add_stats(row, "e2e_latency", [m.e2e for m in ms])
    row["concurrency"] = sum(m.e2e for m in ms) / dur
    t0 = row_start if row_start is not None else min((r.send_time for r in records), default=0.0)
    buckets: Counter = Counter()
    for r, m in done:
        for t, n in m.token_times:
            buckets[int(r.send_time + t - t0)] += n
    row["max_output_tokens_per_s"] = max(buckets.values(), default=0)
    row["max_concurrent_requests"] = max_concurrent(records)
    if details:
        row.update(input_lens=[m.input_tokens for m in ms], output_lens=[m.output_tokens for m in ms],
                   ttfts=[m.ttft for m in ms], itls=[m.itl for m in ms],
                   errors=[f"{k}: {r.error}" for r, k in zip(failed, classes)])
    return row
