"""Speculation under a grammar: drafts cut where the grammar rejects them, one mask per chain position.

A request held to a plain grammar (:class:`tidal.engine.grammar.GrammarMatcher`, no choice points)
drafts like a free one; then its matcher walks the drafts. Chain position j's mask is computed in
the grammar state after drafts[:j] -- the mask plain decoding would compute there once those
tokens were committed -- and the draft is cut before the first token that mask forbids (or that
ends the request: a stop token). The matcher is then rolled back by exactly the tokens it
consumed, so the engine's commit (``EngineCore._append``) advances it from the pre-draft state by
the committed tokens, as in plain decoding.

The verify samples chain position j with its frozen mask (:class:`FrozenMask`), so a greedy chain
commits the tokens plain constrained decoding would, and rejection sampling draws from the masked
target distribution. A drafter's own distribution q is renormalised to each position's mask
(:func:`masked_probs`): a draft kept is then distributed as q restricted to the allowed tokens,
and a draft cut falls back to sampling the target at that position, so the committed tokens stay
distributed as plain sampling would draw them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tidal.engine.grammar import GrammarMatcher, _set_bits, unpack_bitmask


class FrozenMask:
    """One chain position's token mask, computed during drafting (a
    :class:`tidal.engine.grammar.TokenConstraint` the sampler fills a row from; never committed to)."""

    __slots__ = ("words",)

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words  # int32 [(V + 31) // 32]: bit t % 32 of word t // 32 set when t is allowed

    def fill(self, words: torch.Tensor) -> None:
        n = min(words.numel(), self.words.numel())
        words[:n].copy_(self.words[:n])

    def accept(self, token_id: int) -> None:
        raise RuntimeError("a chain position's frozen mask is not a request's constraint")

    def allows(self, token_id: int) -> bool:
        w = token_id // 32
        return 0 <= w < self.words.numel() and bool((int(self.words[w]) >> (token_id % 32)) & 1)

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool."""
        return unpack_bitmask(self.words[None], vocab_size)[0]


def speculable(constraint: Any) -> bool:
    """Whether a request with ``constraint`` may speculate: a plain grammar matcher that is live
    (choice points, token healing and failed or finished grammars decode plainly)."""
    return (type(constraint) is GrammarMatcher and constraint.failed is None
            and not constraint.matcher.is_stopped())


def _mask_now(m: GrammarMatcher, num_words: int) -> FrozenMask:
    """The mask plain decoding computes for ``m``'s current state (``allowed_tokens``: the
    grammar's tokens, plus the request's stop tokens once the grammar may end)."""
    words = torch.zeros(num_words, dtype=torch.int32)
    m.fill(words)
    extra = [t for t in m.extra_allowed() if 0 <= t < 32 * num_words]
    if extra:
        more = torch.zeros_like(words)
        _set_bits(more, torch.tensor(extra, dtype=torch.long))
        words |= more
    return FrozenMask(words)


def grammar_cut(m: GrammarMatcher, tokens: Sequence[int], vocab_size: int) -> tuple[list[int], list[FrozenMask]]:
    """(the drafts ``tokens`` up to the first the grammar forbids or that is a stop token, the
    masks of chain positions 0 .. len(kept)). ``m`` is left in the state it had (rolled back)."""
    num_words = (vocab_size + 31) // 32
    stops = set(m.stop_token_ids) | set(m.compiler.eos_token_ids)
    masks = [_mask_now(m, num_words)]
    kept: list[int] = []
    try:
        for t in tokens:
            if t in stops or not masks[-1].allows(t) or m.matcher.validate_tokens([t]) != 1:
                break
            if not m.matcher.consume_token(t):  # validated above: the matcher cannot fail here
                raise RuntimeError(f"the grammar matcher rejected validated draft token {t}: {m.matcher.get_error()}")
            kept.append(t)
            masks.append(_mask_now(m, num_words))
            if m.matcher.is_stopped():  # nothing but a stop token follows
                break
    finally:
        if kept and not m.matcher.rollback(len(kept)):
            raise RuntimeError(f"the grammar matcher could not roll back {len(kept)} draft tokens")
    return kept, masks


def masked_probs(probs: torch.Tensor, masks: Sequence[FrozenMask]) -> torch.Tensor:
    """The drafter's distributions [k, V] renormalised to the positions' masks (row j to masks[j];
    a row left without mass stays zero: its draft has q = 0 and is never accepted)."""
    allowed = torch.stack([m.allowed(probs.shape[1]) for m in masks[: probs.shape[0]]]).to(probs.device)
    q = probs.masked_fill(~allowed, 0)
    return q / q.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
