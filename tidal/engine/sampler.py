"""Token sampling for one step, vectorised over the batch.

Per row: ban tokens (min_tokens), then greedy argmax, or temperature -> top-k -> top-p -> min-p
and a draw. The draw is ``argmax(p / q)`` with q ~ Exp(1) noise (equivalent to sampling from p);
a seeded request draws its noise from its own ``torch.Generator``, so its tokens do not depend on
the rest of the batch. Logprobs are of the raw model distribution (log_softmax of the logits), as
vLLM returns them by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """What the sampler needs of one request this step."""

    params: SamplingParams
    generator: torch.Generator | None = None
    banned: tuple[int, ...] = ()


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


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleResult]:
    """One token per row of ``logits`` [B, V]."""
    B, V = logits.shape
    dev = logits.device
    raw = logits.float()
    banned_rows = [(i, t) for i, r in enumerate(rows) for t in r.banned if 0 <= t < V]
    if banned_rows:
        raw = raw.clone()
        ri, ti = zip(*banned_rows)
        raw[list(ri), list(ti)] = float("-inf")
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    tokens = torch.empty(B, dtype=torch.long, device=dev)
    if greedy:
        tokens[greedy] = raw[greedy].argmax(dim=-1)
    if random:
        sub = [rows[i] for i in random]
        x = filter_logits(raw[random], sub)
        probs = x.softmax(dim=-1)
        q = _exponential_noise((len(random), V), sub, dev)
        tokens[random] = (probs / q).argmax(dim=-1)
    token_list = tokens.tolist()
    results = [SampleResult(token_id=t) for t in token_list]
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
    return results


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
