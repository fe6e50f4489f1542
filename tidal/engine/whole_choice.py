"""Whole-name choice: at a grammar's :class:`~tidal.sampling_params.ChoicePoint` (a chat reply's
tool name) the engine scores every option whole and writes the best one, instead of letting the
token mask decide token by token.

Why: token-by-token masking keeps every declared name possible, but the model commits at the
first token where the names differ (``get`` against ``create``), so a name whose first piece is
common wins whatever the rest says. Scoring each option as one string -- the sum of the model's
log-probabilities of its canonical tokenisation, as SGLang's frontend ``select`` does -- compares
the names the request's words actually support.

Cost: the engine already holds the request's state after its last token (KDA states in its state
block, MLA latents in its pages) and that token's logits, so each option is scored by a forward of
only its own tokens on top of a copy of that state (:func:`score_after`), never a second prefill of
the prompt. :func:`score_continuations` computes the same from the tokens alone (its own prefill):
the reference the tests hold the engine's scores to.

Exactness: an option's score is a function of the request's state and its own tokens (a forward of
batch one from its own copy of the state), ties go to the earliest option, and a seeded request
draws with its own generator; the state is the engine's, so the pick is as independent of the
batch, the chunking and the cache as the request's greedy tokens are (bit for bit under
``--enable-deterministic-inference``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tidal.engine.grammar import GrammarMatcher, _set_bits
from tidal.model.context import SimpleCache, simple_batch
from tidal.sampling_params import ChoicePoint, SamplingParams


def resolve_points(points: Sequence[ChoicePoint], tokenizer: Any) -> list[tuple[int, list[list[int]]]]:
    """(trigger token id, each option's canonical tokens ``encode(lead + option)``) per point.
    The text after a special token is tokenised on its own (markers are never merged with
    text), so this is how the renderer spells it in a prompt. ValueError naming an unknown marker."""
    out = []
    for p in points:
        trigger = tokenizer.special_tokens.get(p.after)
        if trigger is None:
            raise ValueError(f"choice point after {p.after!r}: the tokenizer has no such special token")
        out.append((trigger, [list(tokenizer.encode(p.lead + o)) for o in p.options]))
    return out


class WholeChoiceMatcher(GrammarMatcher):
    """A grammar matcher with choice points. When the committed token is a point's trigger and
    the grammar accepts two or more of its options here, the matcher holds them in ``pending``;
    the engine scores them (:func:`score_after`) and calls :meth:`choose`; the chosen
    option's tokens are then forced one per step, and the grammar continues after them."""

    def __init__(self, inner: GrammarMatcher, points: list[tuple[int, list[list[int]]]]) -> None:
        super().__init__(inner.compiler, inner.matcher, inner.stop_token_ids)
        self.points = points
        self.pending: list[tuple[int, list[int]]] | None = None  # (option index, tokens) still open
        self.forced: list[int] = []  # the chosen option's tokens not yet committed
        self.chosen: list[int] = []  # the option index picked at each point reached, in order

    @property
    def forcing(self) -> bool:
        return bool(self.forced)

    def fill(self, words: torch.Tensor) -> None:
        if self.forced:
            _set_bits(words, torch.tensor([self.forced[0]], dtype=torch.long))
        else:
            super().fill(words)

    def extra_allowed(self) -> tuple[int, ...]:
        return () if self.forced else super().extra_allowed()

    def accept(self, token_id: int) -> None:
        super().accept(token_id)
        if self.forced:
            # Invariant: while forcing, the mask allows only forced[0], so that is what comes.
            self.forced = self.forced[1:] if token_id == self.forced[0] else []
            return
        self.pending = None
        if self.failed is not None:
            return
        for trigger, options in self.points:
            if token_id != trigger:
                continue
            open_ = [(i, ids) for i, ids in enumerate(options) if ids and self.matcher.validate_tokens(ids) == len(ids)]
            if len(open_) >= 2:
                self.pending = open_
                return

    def choose(self, k: int) -> None:
        """Force the ``k``-th pending option (an index into ``pending``)."""
        assert self.pending is not None
        index, ids = self.pending[k]
        self.chosen.append(index)
        self.forced = list(ids)
        self.pending = None

    def decline(self) -> None:
        """Leave this point to the token mask (the engine cannot score this request)."""
        self.pending = None


@torch.no_grad()
def score_continuations(model: Any, prefix: Sequence[int], continuations: Sequence[Sequence[int]]) -> list[float]:
    """Log-probability (float64 sum) of each continuation after ``prefix`` under ``model``, from the
    tokens alone: one forward over the prefix into a reference cache, then :func:`score_after`."""
    if not prefix or any(not c for c in continuations):
        raise ValueError("score_continuations needs a non-empty prefix and non-empty continuations")
    config = model.config
    device = next(model.parameters()).device
    cache = SimpleCache(config, 1, model.dtype, device)
    ids = torch.tensor(list(prefix), dtype=torch.long, device=device)
    hidden = model(ids, simple_batch(config, [len(prefix)], cache, [0]))
    return score_after(model, cache, len(prefix), model.compute_logits(hidden[-1:])[0], continuations)


@torch.no_grad()
def score_after(model: Any, cache: SimpleCache, length: int, last_logits: torch.Tensor,
                continuations: Sequence[Sequence[int]]) -> list[float]:
    """Log-probability (float64 sum) of each continuation after a sequence of ``length`` tokens
    whose state is ``cache`` (one sequence; left as it is) and whose last position gave
    ``last_logits`` [vocab]: a continuation's first token is scored from those logits, the rest by a
    forward of its own tokens but the last from its own fork of the cache, batch of one -- a
    continuation's score depends on the state and its own tokens only."""
    if length < 1 or any(not c for c in continuations):
        raise ValueError("score_after needs a non-empty sequence and non-empty continuations")
    config = model.config
    device = next(model.parameters()).device
    first = torch.log_softmax(last_logits.double(), dim=-1)
    scores = []
    for cont in continuations:
        total = float(first[cont[0]])
        if len(cont) > 1:
            rest = torch.tensor(list(cont[:-1]), dtype=torch.long, device=device)
            h = model(rest, simple_batch(config, [len(cont) - 1], cache.fork(), [length]))
            logp = torch.log_softmax(model.compute_logits(h).double(), dim=-1)
            targets = torch.tensor(list(cont[1:]), dtype=torch.long, device=device)
            total += float(logp.gather(1, targets[:, None]).sum())
        scores.append(total)
    return scores


def pick(scores: Sequence[float], params: SamplingParams, generator: torch.Generator | None) -> int:
    """The option to write: the best score (the earliest on a tie) when greedy, else a draw from
    softmax(score / temperature) with the request's generator."""
    if params.temperature == 0:
        best = max(scores)
        return next(i for i, s in enumerate(scores) if s == best)
    top = max(scores)
    device = generator.device if generator is not None else "cpu"
    weights = torch.tensor([math.exp((s - top) / params.temperature) for s in scores], dtype=torch.float64,
                           device=device)
    return int(torch.multinomial(weights, 1, generator=generator))
