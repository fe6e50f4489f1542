"""Runs one scheduled step through the model: flat token run + pool-backed cache -> logits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.cache.pool import MemoryPool, PoolCacheView
from tidal.engine.cuda_graph import DEFAULT_MAX_BS, DecodeGraphs
from tidal.engine.scheduler import ScheduledBatch
from tidal.model.context import ForwardBatch
from tidal.engine.request import ImageItem, Request
from tidal.model.kimi import KimiForCausalLM
from tidal.multimodal.encoder_cache import EncoderCache
from tidal.ops import batch_invariant


@dataclass
class StepLogits:
    """Logits of the rows the step needs: one per sampling request, plus prompt-logprob rows."""

    sample_seqs: list[int] = field(default_factory=list)  # batch positions that sample a token
    sample_logits: torch.Tensor | None = None  # [len(sample_seqs), V]
    # batch position -> (prompt positions t, logits [len(t), V] scoring prompt token t+1)
    prompt: dict[int, tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    # Speculation: batch position -> logits [chain length, V] of every chain position, and the
    # chains' layout (tidal.spec.verify.VerifyLayout), which the commit needs.
    chains: dict[int, torch.Tensor] = field(default_factory=dict)
    verify: Any = None


class ModelRunner:
    """Runs steps eagerly, or (on a GPU, unless ``cuda_graph`` is off) pure decode steps of up to
    ``cuda_graph_max_bs`` sequences as captured CUDA graphs (``tidal.engine.cuda_graph``)."""

    def __init__(
        self, model: KimiForCausalLM, pool: MemoryPool, encoder_cache: EncoderCache | None = None,
        cuda_graph: bool = True, cuda_graph_max_bs: int = DEFAULT_MAX_BS, max_context: int | None = None,
        deterministic: bool = False,
    ) -> None:
        self.model = model
        self.deterministic = deterministic  # every step in tidal.ops.batch_invariant's mode
        self.pool = pool
        self.encoder_cache = encoder_cache if encoder_cache is not None else EncoderCache(0)
        self.device = next(model.parameters()).device
        model.process_weights_after_loading()
        self.graphs: DecodeGraphs | None = None
        if cuda_graph and self.device.type == "cuda" and cuda_graph_max_bs > 0:
            context = max_context or model.config.max_position_embeddings
            self.graphs = DecodeGraphs(model, pool, cuda_graph_max_bs, context)
            self.graphs.capture_all()

    def execute(self, batch: ScheduledBatch) -> StepLogits:
        """:meth:`run_step`, in deterministic mode when the engine asks for it."""
        with batch_invariant.deterministic_mode(self.deterministic):
            return self.run_step(batch)

    @torch.inference_mode()
    def run_step(self, batch: ScheduledBatch) -> StepLogits:
        """Run the step's tokens; the returned rows refer to positions in ``batch``.

        The model sees the sequences decode-first and ordered by state block, so the decoding
        requests' KDA states (which the pool keeps side by side) are updated in place through a few
        strided views (see ``ForwardBatch.decode_runs``); the order changes nothing else."""
        order = sorted(range(len(batch.requests)),
                       key=lambda b: (batch.query_lens[b] > 1, self.pool.state_block(batch.requests[b].request_id)))
        reqs = [batch.requests[b] for b in order]
        query_lens = [batch.query_lens[b] for b in order]
        cached_lens = [batch.cached_lens[b] for b in order]
        ids: list[int] = []
        for b, req, n, c in zip(order, reqs, query_lens, cached_lens):
            draft = batch.drafts.get(b)
            ids.extend(req.token_ids[c : c + n] if draft is None else [req.token_ids[c], *draft.tokens])
        owners = [r.request_id for r in reqs]
        verify = None
        if batch.drafts:
            chains = [i for i, b in enumerate(order) if b in batch.drafts]
            verify = batch.chain_memory.layout(chains, [owners[i] for i in chains])
        if self.graphs is not None and len(reqs) <= self.graphs.max_bs and all(n == 1 for n in query_lens):
            hidden = self.graphs.run(owners, ids, cached_lens)
            cu = list(range(len(reqs) + 1))
        else:
            cache = PoolCacheView(self.pool, owners, query_lens, cached_lens)
            fb = ForwardBatch(query_lens=query_lens, cached_lens=cached_lens, cache=cache, verify=verify)
            images = self._image_embeds(reqs, query_lens, cached_lens, fb)
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), fb, images)
            cu = fb.cu_seqlens

        out = StepLogits(verify=verify)
        rows: list[int] = []
        prompt_rows: list[tuple[int, list[int], int]] = []  # (seq in batch, positions, start in rows)
        for i, (req, n, c) in enumerate(zip(reqs, query_lens, cached_lens)):
            positions = req.prompt_logprob_positions(c, n)
            if positions:
                prompt_rows.append((order[i], positions, len(rows)))
                rows.extend(cu[i] + t - c for t in positions)
        first_sample = len(rows)
        for i, (req, n, c) in enumerate(zip(reqs, query_lens, cached_lens)):
            if c + n == req.num_tokens:
                out.sample_seqs.append(order[i])
                rows.append(cu[i + 1] - 1)
        first_chain = len(rows)
        chain_rows: list[tuple[int, int, int]] = []  # (seq in batch, start in rows, length)
        for i, b in enumerate(order):
            if b in batch.drafts:
                chain_rows.append((b, len(rows), query_lens[i]))
                rows.extend(range(cu[i], cu[i + 1]))
        if not rows:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        if first_chain > first_sample:
            out.sample_logits = logits[first_sample:first_chain]
        for b, start, m in chain_rows:
            out.chains[b] = logits[start : start + m]
        for b, positions, start in prompt_rows:
            out.prompt[b] = (positions, logits[start : start + len(positions)])
        return out

    def image_embeds(self, item: ImageItem) -> torch.Tensor:
        """One image's placeholder embeddings [num_tokens, hidden]: the tower runs once per image
        hash while the encoder cache keeps it."""
        def encode() -> torch.Tensor:
            patches = item.image.patches.to(self.device)
            return self.model.embed_image(patches, item.image.grid)

        return self.encoder_cache.get_or_compute(item.image.hash, encode)

    def _image_embeds(self, reqs: list[Request], query_lens: list[int], cached_lens: list[int],
                      fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions in the flat run, embeddings) of the image placeholders this step computes:
        each chunk takes the rows of its part of an image's span, so a chunk boundary anywhere
        inside an image gives the same embeddings as one chunk."""
        positions: list[int] = []
        parts: list[torch.Tensor] = []
        for i, (req, n, c) in enumerate(zip(reqs, query_lens, cached_lens)):
            for item in req.images:
                lo, hi = max(c, item.offset), min(c + n, item.end)
                if lo >= hi:
                    continue
                parts.append(self.image_embeds(item)[lo - item.offset : hi - item.offset])
                start = fb.cu_seqlens[i] + lo - c
                positions.extend(range(start, start + hi - lo))
        if not parts:
            return None
        return torch.tensor(positions, dtype=torch.long, device=self.device), torch.cat(parts)
