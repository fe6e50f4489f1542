"""What the speculation loop asks of a drafter, and the n-gram (prompt lookup) drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch


@dataclass
class Draft:
    """Drafted tokens for one request; ``probs`` [len(tokens), V] is the distribution each was
    drawn from (None: chosen deterministically, q one-hot), which rejection sampling needs.
    ``confidence`` (one per token, None: unknown) is the drafter's own probability of each token
    given the ones before it, which the speculation loop uses to choose how many to verify."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None


class Drafter(Protocol):
    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> Draft | None:
        """Up to ``num_tokens`` tokens likely to follow ``token_ids`` (None or empty: no guess)."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a request that left."""
        ...


def propose_all(drafter: Drafter, asks: Sequence[tuple[str, Sequence[int], int]],
                min_reach: float = 0.0) -> list[Draft | None]:
    """The drafts for several (request, its tokens, drafts wanted): in one call where the drafter
    batches them (``propose_many``, which may stop drafting a block once no token past it would
    be verified: see :func:`confident_prefix`), else one request at a time."""
    many = getattr(drafter, "propose_many", None)
    if many is not None:
        return many(asks, min_reach)
    return [drafter.propose(*ask) for ask in asks]


def confident_prefix(draft: Draft, least: float) -> int:
    """How many of ``draft``'s tokens have a chance of at least ``least`` of being reached (the
    drafter's confidences multiplied along the chain); all of them where it gives none."""
    if draft.confidence is None or least <= 0.0:
        return len(draft.tokens)
    reach = 1.0
    for j, p in enumerate(draft.confidence):
        reach *= p
        if reach < least:
            return j
    return len(draft.tokens)


@dataclass
class _Index:
    """Latest end of every n-gram of one request: ``ends[m][gram] = e`` with token_ids[e-m:e] ==
    gram, for every e up to ``indexed`` (exclusive of the current suffix's end)."""

    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0


class NgramDrafter:
    """Prompt lookup (SGLang NGRAM, vLLM ``ngram``): find the latest earlier occurrence of the
    request's last ``max_match`` .. ``min_match`` tokens in its own prompt and output, and propose
    what followed it (a match that runs into the suffix repeats with its period). The index grows by the new tokens of each call (O(new tokens x sizes))."""

    def __init__(self, max_match: int = 4, min_match: int = 1) -> None:
        self.max_match, self.min_match = max_match, min_match
        self._index: dict[str, _Index] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> Draft | None:
        n = len(token_ids)
        idx = self._index.setdefault(request_id, _Index())
        if idx.indexed > n:  # not the same request any more
            idx = self._index[request_id] = _Index()
        for e in range(max(idx.indexed, self.min_match), n):
            for m in range(self.min_match, min(self.max_match, e) + 1):
                idx.ends.setdefault(m, {})[tuple(token_ids[e - m : e])] = e
        idx.indexed = max(idx.indexed, n)
        for m in range(min(self.max_match, n), self.min_match - 1, -1):
            e = idx.ends.get(m, {}).get(tuple(token_ids[n - m :]))
            if e is not None:
                # Past the end the match continues with itself: a repeat of period n - e.
                tokens: list[int] = []
                for i in range(num_tokens):
                    tokens.append(token_ids[e + i] if e + i < n else tokens[i - (n - e)])
                return Draft(tokens)
        return None

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
