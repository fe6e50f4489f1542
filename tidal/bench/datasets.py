"""Single-turn workloads: random prompts of exact token length and Mooncake trace replay.

Every prompt is built from a seeded generator, so a seed reproduces the run. Different sweep
rows get different prompt contents (``salt``) with the same lengths, so no row is served from
the prefix cache another row filled."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tidal.bench.tokenizer import FALLBACK_ID_RANGE, BenchTokenizer


@dataclass
class BenchRequest:
    """One request to send. ``prompt`` (text or token ids) goes to /v1/completions; chat sends
    ``messages`` (a text prompt becomes one user message). ``arrival``: seconds after the row
    starts (trace replay), None to follow --request-rate."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    input_len: int = 0
    output_len: int = 0
    arrival: float | None = None
    meta: dict = field(default_factory=dict)


def random_lengths(rng: np.random.Generator, n: int, length: int, ratio: float | None,
                   semantics: str = "sglang") -> np.ndarray:
    """Per-request lengths. ratio None: all exactly ``length``. SGLang: uniform integers in
    [max(int(L*r), 1), L]. vLLM: uniform integers in [int(L*(1-r)), int(L*(1+r))], r < 1.
    Both ends included; lengths are at least 1."""
    if ratio is None:
        return np.full(n, length, dtype=np.int64)
    if semantics == "sglang":
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"SGLang range ratio must be in [0, 1], got {ratio}")
        lo, hi = max(int(length * ratio), 1), length
    elif semantics == "vllm":
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"vLLM range ratio must be in [0, 1), got {ratio}")
        lo, hi = max(int(length * (1 - ratio)), 1), max(int(length * (1 + ratio)), 1)
    else:
        raise ValueError(f"unknown range semantics {semantics!r} (sglang or vllm)")
    return rng.integers(lo, hi + 1, size=n)


def token_pool(tokenizer: BenchTokenizer | None) -> np.ndarray:
    if tokenizer is None:
        return np.arange(*FALLBACK_ID_RANGE, dtype=np.int64)
    return tokenizer.allowed_ids()


def fit_text(tokenizer: BenchTokenizer, ids: Sequence[int], length: int, pool: np.ndarray,
             rng: np.random.Generator, max_rounds: int = 16) -> tuple[str, int]:
    """Text that encodes to exactly ``length`` tokens, starting from the decoded ``ids``.

    decode -> encode changes the count (tokens merge or split at boundaries), so: truncate when
    long, append pool tokens when short, re-decode, repeat. Only the tail moves, which keeps a
    shared prefix shared. Returns (text, its token count) - the count differs from ``length``
    only if no round converged."""
    text = tokenizer.decode(list(ids))
    best: tuple[str, int] | None = None
    for _ in range(max_rounds):
        enc = tokenizer.encode(text)
        if best is None or abs(len(enc) - length) < abs(best[1] - length):
            best = (text, len(enc))
        if len(enc) == length:
            break
        enc = enc[:length] if len(enc) > length else enc + rng.choice(pool, size=length - len(enc)).tolist()
        text = tokenizer.decode(enc)
    return best


def make_prompt(ids: Sequence[int], length: int, fmt: str, tokenizer: BenchTokenizer | None,
                pool: np.ndarray, rng: np.random.Generator) -> tuple[str | list[int], int]:
    """(prompt, token count) as token ids or as text re-encoded to the exact length."""
    if fmt == "ids":
        return [int(i) for i in ids[:length]], min(len(ids), length)
    if tokenizer is None:
        raise ValueError("text prompts of exact length need a tokenizer (--tokenizer, or a server with /tokenize)")
    return fit_text(tokenizer, ids, length, pool, rng)


def random_requests(n: int, input_len: int, output_len: int, *, tokenizer: BenchTokenizer | None,
                    range_ratio: float | None = None, semantics: str = "sglang", fmt: str = "text",
                    seed: int = 0, salt: int = 0) -> list[BenchRequest]:
    """Random prompts: lengths drawn from ``seed`` (same for every salt), token contents drawn
    uniformly from the tokenizer's ordinary ids with a generator seeded by (seed, salt)."""
    rng = np.random.default_rng(seed)
    in_lens = random_lengths(rng, n, input_len, range_ratio, semantics)
    out_lens = random_lengths(rng, n, output_len, range_ratio, semantics)
    content_rng = np.random.default_rng([seed, salt])
    pool = token_pool(tokenizer)
    out = []
    for i in range(n):
        ids = content_rng.choice(pool, size=int(in_lens[i]))
        prompt, n_tok = make_prompt(ids, int(in_lens[i]), fmt, tokenizer, pool, content_rng)
        out.append(BenchRequest(prompt=prompt, input_len=n_tok, output_len=int(out_lens[i])))
    return out


@dataclass
class TraceEntry:
    """One Mooncake trace line: ``timestamp`` in ms since the trace start; ``hash_ids`` name
    fixed-size prompt blocks, equal leading ids mean a shared prefix."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceEntry]:
    entries = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                entries.append(TraceEntry(float(d.get("timestamp", 0)), int(d["input_length"]),
                                          int(d["output_length"]), [int(h) for h in d.get("hash_ids", [])]))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({e})") from e
            if limit is not None and len(entries) >= limit:
                break
    return entries


def trace_requests(entries: Sequence[TraceEntry], *, tokenizer: BenchTokenizer | None, block_size: int = 512,
                   fmt: str = "text", seed: int = 0, salt: int = 0, time_scale: float = 1.0) -> list[BenchRequest]:
    """Replay requests: block ``h`` is ``block_size`` tokens drawn from a generator seeded by
    (seed, salt, h), so equal hash ids give equal token prefixes; the prompt is the blocks in
    order, cut (or extended with request-unique tokens) to ``input_length``. Arrivals are the
    timestamps (ms) times ``time_scale``, relative to the first entry."""
    pool = token_pool(tokenizer)
    blocks: dict[int, np.ndarray] = {}
    t0 = min((e.timestamp for e in entries), default=0.0)
    out = []
    for k, e in enumerate(entries):
        parts = []
        for h in e.hash_ids:
            if h not in blocks:
                blocks[h] = np.random.default_rng([seed, salt, h]).choice(pool, size=block_size)
            parts.append(blocks[h])
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        rng = np.random.default_rng([seed, salt, 1 << 40, k])
        if len(ids) < e.input_length:
            ids = np.concatenate([ids, rng.choice(pool, size=e.input_length - len(ids))])
        prompt, n_tok = make_prompt(ids[: e.input_length], e.input_length, fmt, tokenizer, pool, rng)
        out.append(BenchRequest(prompt=prompt, input_len=n_tok, output_len=max(e.output_length, 1),
                                arrival=(e.timestamp - t0) / 1000.0 * time_scale,
                                meta={"hash_ids": list(e.hash_ids)}))
    return out
