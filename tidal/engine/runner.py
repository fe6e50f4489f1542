"""Runs one scheduled step through the model: flat token run + pool-backed cache -> logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal.cache.pool import MemoryPool, PoolCacheView
from tidal.engine.scheduler import ScheduledBatch
from tidal.model.context import ForwardBatch
from tidal.model.kimi import KimiForCausalLM


@dataclass
class StepLogits:
    """Logits of the rows the step needs: one per sampling request, plus prompt-logprob rows."""

    sample_seqs: list[int] = field(default_factory=list)  # batch positions that sample a token
    sample_logits: torch.Tensor | None = None  # [len(sample_seqs), V]
    # batch position -> (prompt positions t, logits [len(t), V] scoring prompt token t+1)
    prompt: dict[int, tuple[list[int], torch.Tensor]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, pool: MemoryPool) -> None:
        self.model = model
        self.pool = pool
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        ids: list[int] = []
        for req, n, c in zip(batch.requests, batch.query_lens, batch.cached_lens):
            ids.extend(req.token_ids[c : c + n])
        owners = [r.request_id for r in batch.requests]
        cache = PoolCacheView(self.pool, owners, batch.query_lens, batch.cached_lens)
        fb = ForwardBatch(query_lens=list(batch.query_lens), cached_lens=list(batch.cached_lens), cache=cache)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), fb)

        out = StepLogits()
        rows: list[int] = []
        prompt_rows: list[tuple[int, list[int], int]] = []  # (seq, positions, start in rows)
        for b, (req, n, c) in enumerate(zip(batch.requests, batch.query_lens, batch.cached_lens)):
            positions = req.prompt_logprob_positions(c, n)
            if positions:
                prompt_rows.append((b, positions, len(rows)))
                rows.extend(fb.cu_seqlens[b] + t - c for t in positions)
        first_sample = len(rows)
        for b, (req, n, c) in enumerate(zip(batch.requests, batch.query_lens, batch.cached_lens)):
            if c + n == req.num_tokens:
                out.sample_seqs.append(b)
                rows.append(fb.cu_seqlens[b + 1] - 1)
        if not rows:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        out.sample_logits = logits[first_sample:]
        for b, positions, start in prompt_rows:
            out.prompt[b] = (positions, logits[start : start + len(positions)])
        return out
