"""Token sampling for one step, vectorised over the batch.

Per row, in vLLM's order: logit_bias, then ban tokens (the stop tokens inside min_tokens), then
the repetition / frequency / presence penalties, then the constraint's token mask (grammar or
token healing, :mod:`tidal.engine.grammar`); then greedy argmax, or temperature -> top-k ->
top-p -> min-p and a draw. The draw is ``argmax(p / q)`` with q ~ Exp(1) noise (equivalent to sampling from p);
a seeded request draws its noise from its own ``torch.Generator``, so its tokens do not depend on
the rest of the batch. Logprobs are of the raw model distribution (log_softmax of the logits), as
vLLM returns them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.ops.argmax import argmax_rows
from tidal.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """What the sampler needs of one request this step: ``token_ids`` is prompt + output so far
    (its first ``prompt_len`` are the prompt), read only when the request has penalties;
    ``constraint`` (a :class:`tidal.engine.grammar.TokenConstraint`) masks what may come next."""

    params: SamplingParams
    generator: torch.Generator | None = None
    banned: tuple[int, ...] = ()
    token_ids: Sequence[int] = ()
    prompt_len: int = 0
    constraint: Any = None


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # of token_id; set when the row asked for logprobs
    rank: int | None = None
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), best first


def filter_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature-scaled logits with top-k / top-p / min-p exclusions set to -inf ([B, V] float32).
    Greedy rows are left at temperature 1 (the caller takes their argmax)."""
    B, V = logits.shape
    dev = logits.device
    x = logits.float().clone()
    temp = torch.tensor([r.params.temperature or 1.0 for r in rows], dtype=torch.float32, device=dev)
    x.div_(temp[:, None])
    top_k = [r.params.top_k if r.params.top_k > 0 else V for r in rows]
    top_p = [float(r.params.top_p) for r in rows]
    if any(k < V for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_x, order = x.sort(dim=-1, descending=True)
        k = torch.tensor([min(k, V) for k in top_k], device=dev)
        position = torch.arange(V, device=dev)[None, :]
        drop = position >= k[:, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        p = torch.tensor([q if q < 1.0 else float("inf") for q in top_p], dtype=torch.float32, device=dev)
        drop |= mass_before >= p[:, None]  # keeps the first token always (mass before it is 0)
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    min_p = [float(r.params.min_p) for r in rows]
    if any(m > 0.0 for m in min_p):
        probs = x.softmax(dim=-1)
        m = torch.tensor(min_p, dtype=torch.float32, device=dev)
        x = x.masked_fill(probs < m[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return x


def _exponential_noise(shape: tuple[int, int], rows: list[SampleRow], device: torch.device) -> torch.Tensor:
    q = torch.empty(shape, dtype=torch.float32, device=device)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        q[unseeded] = torch.empty(len(unseeded), shape[1], device=device).exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            q[i].exponential_(generator=r.generator)
    return q.clamp_(min=torch.finfo(torch.float32).tiny)


def _scatter_rows(rows: list[int], cols: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row, column) index tensors of ``cols[j]`` in row ``rows[j]``."""
    r = [i for i, c in zip(rows, cols) for _ in c]
    flat = [t for c in cols for t in c]
    return (torch.tensor(r, dtype=torch.long, device=device), torch.tensor(flat, dtype=torch.long, device=device))


def apply_penalties(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties,
    in place on the rows of ``x`` [B, V] that have any."""
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return x
    V, dev = x.shape[1], x.device
    local = list(range(len(idx)))
    outputs = [[t for t in rows[i].token_ids[rows[i].prompt_len:] if 0 <= t < V] for i in idx]
    counts = torch.zeros(len(idx), V, dtype=torch.float32, device=dev)
    ri, ti = _scatter_rows(local, outputs, dev)
    counts.index_put_((ri, ti), torch.ones(len(ti), device=dev), accumulate=True)
    sub = x[idx]
    rep = torch.tensor([rows[i].params.repetition_penalty for i in idx], dtype=torch.float32, device=dev)[:, None]
    if bool((rep != 1.0).any()):
        seen = counts > 0
        prompts = [[t for t in rows[i].token_ids[: rows[i].prompt_len] if 0 <= t < V] for i in idx]
        ri, ti = _scatter_rows(local, prompts, dev)
        seen[ri, ti] = True
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([rows[i].params.frequency_penalty for i in idx], dtype=torch.float32, device=dev)[:, None]
    pres = torch.tensor([rows[i].params.presence_penalty for i in idx], dtype=torch.float32, device=dev)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).float()
    x[idx] = sub
    return x


def process_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The logits the draw sees ([B, V] float32): bias, bans, penalties and constraint masks
    applied. A row whose constraint leaves none of its unbanned tokens keeps the constraint and
    drops the ban (the grammar decides: a stop token it requires is allowed inside min_tokens)."""
    B, V = logits.shape
    dev = logits.device
    raw = logits.float()
    touched = any(r.params.logit_bias or r.banned or r.params.has_penalties or r.constraint is not None
                  for r in rows)
    if not touched:
        return raw
    x = raw.clone()
    biased = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items() if t < V]
    if biased:
        ri, ti, bi = zip(*biased)
        x.index_put_((torch.tensor(ri, device=dev), torch.tensor(ti, device=dev)),
                     torch.tensor(bi, dtype=torch.float32, device=dev), accumulate=True)
    x = apply_penalties(x, rows)
    constrained = [i for i, r in enumerate(rows) if r.constraint is not None]
    allowed = None
    if constrained:
        from tidal.engine.grammar import allowed_tokens

        allowed = allowed_tokens([rows[i].constraint for i in constrained], V, dev)
        x[constrained] = x[constrained].masked_fill(~allowed, float("-inf"))
    banned_rows = [(i, t) for i, r in enumerate(rows) for t in r.banned if 0 <= t < V]
    if banned_rows:
        ban = torch.zeros(B, V, dtype=torch.bool, device=dev)
        ri, ti = zip(*banned_rows)
        ban[list(ri), list(ti)] = True
        if allowed is not None:  # never ban a row's last allowed tokens
            left = torch.ones(B, dtype=torch.bool, device=dev)
            left[constrained] = (allowed & ~ban[constrained]).any(dim=-1)
            ban &= left[:, None]
        x = x.masked_fill(ban, float("-inf"))
    return x


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleResult]:
    """One token per row of ``logits`` [B, V]."""
    B, V = logits.shape
    dev = logits.device
    raw = process_logits(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random:  # every row greedy (the usual decode step): no gather of the rows
        tokens = argmax_rows(raw)
    else:
        tokens = torch.empty(B, dtype=torch.long, device=dev)
        if greedy:
            tokens[greedy] = argmax_rows(raw[greedy])
        sub = [rows[i] for i in random]
        x = filter_logits(raw[random], sub)
        probs = x.softmax(dim=-1)
        q = _exponential_noise((len(random), V), sub, dev)
        tokens[random] = (probs / q).argmax(dim=-1)
    results = [SampleResult(token_id=t) for t in tokens.tolist()]
    add_logprobs(logits, tokens, rows, results)
    return results


def add_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow],
                 results: list[SampleResult]) -> None:
    """Fill the logprob, rank and top alternatives of each chosen token (rows that ask for
    logprobs), from the raw model distribution of ``logits`` [B, V]."""
    V = logits.shape[1]
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        lp = logits[want].float().log_softmax(dim=-1)
        chosen = tokens[want]
        chosen_lp = lp.gather(1, chosen[:, None])[:, 0]
        ranks = (lp > chosen_lp[:, None]).sum(dim=-1) + 1
        counts = [V if rows[i].params.logprobs == -1 else min(rows[i].params.logprobs, V) for i in want]
        top_lp, top_ids = lp.topk(max(counts), dim=-1)
        chosen_lp_l, ranks_l = chosen_lp.tolist(), ranks.tolist()
        top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
        for j, (i, n) in enumerate(zip(want, counts)):
            res = results[i]
            res.logprob, res.rank = chosen_lp_l[j], ranks_l[j]
            res.top = list(zip(top_ids_l[j][:n], top_lp_l[j][:n]))


def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], num_top: int
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """For each row of ``logits`` [N, V]: (logprob of targets[row], its rank, top ``num_top``
    alternatives; -1 = the whole vocabulary)."""
    V = logits.shape[1]
    lp = logits.float().log_softmax(dim=-1)
    tgt = torch.tensor(targets, dtype=torch.long, device=logits.device)
    t_lp = lp.gather(1, tgt[:, None])[:, 0]
    ranks = ((lp > t_lp[:, None]).sum(dim=-1) + 1).tolist()
    top_lp, top_ids = lp.topk(V if num_top == -1 else min(num_top, V), dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
    return [(v, r, t) for v, r, t in zip(t_lp.tolist(), ranks, tops)]
