"""Which drafted tokens a chain commits: the longest prefix the target agrees with, plus one.

Greedy: draft d_{j+1} is accepted while it equals the target's token at chain position j (the
sampler's argmax over the same processed logits a plain decode would see there); the first
disagreeing target token, or the one after the last draft, is committed too.

Temperature > 0: lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept
d_{j+1} with probability min(1, p_j(d)/q_j(d)); on a rejection draw from norm(max(0, p_j - q_j))
and stop; when all drafts are accepted draw the bonus token from p at the last position. p is the
target's distribution after penalties, temperature, top-k/top-p/min-p (the sampler's); q is the
drafter's own distribution (one-hot for deterministic drafters). The committed tokens are then
distributed exactly as plain sampling from p would draw them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tidal.engine.sampler import SampleResult, SampleRow, add_logprobs, filter_logits, process_logits, sample


def chain_rows(row: SampleRow, drafts: list[int], eos_bans: tuple[int, ...], output_len: int, min_tokens: int,
               masks: Sequence[Any] | None = None) -> list[SampleRow]:
    """The sampler's row for each chain position j, as plain decode would build it after
    accepting drafts[:j]: the history grows by them, the min_tokens ban lifts on time, and
    ``masks[j]`` (a constrained request's: :mod:`tidal.spec.grammar_draft`) is the grammar's mask
    in the state after drafts[:j]."""
    rows = []
    for j in range(len(drafts) + 1):
        banned = eos_bans if output_len + j < min_tokens else ()
        rows.append(SampleRow(row.params, row.generator, banned, [*row.token_ids, *drafts[:j]], row.prompt_len,
                              masks[j] if masks is not None else None))
    return rows


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device))


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def rejection_sample(probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """probs [m, V]: the target's distribution at each chain position; drafts: the m-1 drafted
    tokens; draft_probs [m-1, V] the distributions they were drawn from (None: one-hot). Returns
    the committed tokens: the accepted drafts, then one drawn token."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = probs[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        if q_d > 0 and _uniform(generator, p.device) < min(1.0, float(p[d]) / q_d):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0
        else:
            residual = (p - draft_probs[j]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q: a rejection has probability 0; fall back to p
            residual = p
        out.append(_draw(residual / residual.sum(), generator))
        return out
    out.append(_draw(probs[len(drafts)], generator))
    return out


def accept_chain(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                 rows: list[SampleRow]) -> list[SampleResult]:
    """logits [m, V] of a chain (position j after accepting drafts[:j]), its m-1 drafts and the
    rows of :func:`chain_rows`; returns the committed tokens' results (logprobs filled where
    asked), at least one."""
    if rows[0].params.greedy:
        results = sample(logits, rows)
        n = 1
        while n <= len(drafts) and results[n - 1].token_id == drafts[n - 1]:
            n += 1
        return results[:n]
    x = filter_logits(process_logits(logits, rows), rows)
    tokens = rejection_sample(x.softmax(dim=-1), drafts, draft_probs, rows[0].generator)
    results = [SampleResult(token_id=t) for t in tokens]
    n = len(tokens)
    add_logprobs(logits[:n], torch.tensor(tokens, dtype=torch.long, device=logits.device), rows[:n], results)
    return results
