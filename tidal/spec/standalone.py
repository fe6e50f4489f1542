"""STANDALONE drafter: a small model of the same family and tokenizer drafts greedily.

Each request keeps the draft model's cache (a :class:`~tidal.model.context.SimpleCache`) at its
committed tokens. A proposal feeds the tokens committed since the last one, then drafts k tokens
one decode at a time on top, and restores the cache to the committed point afterwards (the KDA
states are small: the draft model's, one per request), so rejected drafts never leak into the
next proposal. Drafts are the draft model's argmax (q one-hot: rejection sampling stays lossless).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tidal.model.context import SimpleCache, simple_batch
from tidal.model.kimi import KimiForCausalLM
from tidal.spec.drafter import Draft


@dataclass
class _DraftState:
    cache: SimpleCache
    fed: int = 0  # tokens of the request the cache holds
    last_logits: torch.Tensor | None = None  # after the last fed token


class StandaloneDrafter:
    def __init__(self, model: KimiForCausalLM, target_vocab_size: int) -> None:
        if model.config.vocab_size != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size}) is not the target's "
                             f"({target_vocab_size}): STANDALONE needs the same tokenizer")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self._states: dict[str, _DraftState] = {}

    @property
    def nbytes(self) -> int:
        """The draft model's weights (the engine takes them out of the pool; the per-request draft
        caches are not counted)."""
        return sum(p.nbytes for p in self.model.parameters())

    @classmethod
    def from_path(cls, path: str, target_vocab_size: int, dtype: torch.dtype,
                  device: torch.device) -> "StandaloneDrafter":
        from tidal.model.checkpoint import load_model

        return cls(load_model(path, dtype, device).process_weights_after_loading(), target_vocab_size)

    def _feed(self, state: _DraftState, tokens: Sequence[int]) -> torch.Tensor:
        cached = state.fed
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        hidden = self.model(ids, simple_batch(self.model.config, [len(tokens)], state.cache, [cached]))
        state.fed += len(tokens)
        return self.model.compute_logits(hidden[-1:])[0]

    @torch.inference_mode()
    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> Draft | None:
        n = len(token_ids)
        state = self._states.get(request_id)
        if state is None or state.fed > n:
            state = self._states[request_id] = _DraftState(SimpleCache(self.model.config, 1, self.model.dtype,
                                                                       self.device))
        if state.fed < n:
            state.last_logits = self._feed(state, token_ids[state.fed : n])
        cache = state.cache
        saved = ([t.clone() for t in cache.kda_conv], [t.clone() for t in cache.kda_recurrent],
                 [layer[0].shape[0] for layer in cache.mla])
        tokens = [int(state.last_logits.argmax())]
        for _ in range(num_tokens - 1):
            tokens.append(int(self._feed(state, tokens[-1:]).argmax()))
        cache.kda_conv, cache.kda_recurrent = saved[0], saved[1]
        for layer, length in zip(cache.mla, saved[2]):
            layer[0] = layer[0][:length]
        state.fed = n
        return Draft(tokens)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
