"""Runs one step plan through the model: flat token run + pool-storage cache -> logits."""

from __future__ import annotations

import torch

from tidal.cache.storage import PoolCacheView, PoolStorage
from tidal.engine.cuda_graph import DEFAULT_MAX_BS, DecodeGraphs
from tidal.engine.plan import ImageSpan, StepPlan
from tidal.engine.request import ImageItem
from tidal.model.context import ForwardBatch
from tidal.model.kimi import KimiForCausalLM
from tidal.model.layers import frozen_weights, weights_epoch
from tidal.multimodal.encoder_cache import EncoderCache
from tidal.ops import batch_invariant
from tidal.spec.rollback import SWAP, ReplayWindow
from tidal.spec.verify import VerifyLayout


class ModelRunner:
    """Runs plans eagerly, or (on a GPU, unless ``cuda_graph`` is off) pure decode steps of up to
    ``cuda_graph_max_bs`` sequences as captured CUDA graphs (``tidal.engine.cuda_graph``)."""

    def __init__(
        self, model: KimiForCausalLM, storage: PoolStorage, encoder_cache: EncoderCache | None = None,
        cuda_graph: bool = True, cuda_graph_max_bs: int = DEFAULT_MAX_BS, max_context: int | None = None,
        deterministic: bool = False,
    ) -> None:
        self.model = model
        self.deterministic = deterministic  # every step in tidal.ops.batch_invariant's mode
        self.storage = storage
        self.encoder_cache = encoder_cache if encoder_cache is not None else EncoderCache(0)
        self.device = next(model.parameters()).device
        model.process_weights_after_loading()
        self.weights_epoch = weights_epoch()  # the weights are final from here (see frozen_weights)
        self.last_taps: torch.Tensor | None = None  # the last plan's tapped hidden states (tap_rows)
        self.graphs: DecodeGraphs | None = None
        if cuda_graph and self.device.type == "cuda" and cuda_graph_max_bs > 0:
            context = max_context or model.config.max_position_embeddings
            self.graphs = DecodeGraphs(model, storage, cuda_graph_max_bs, context)
            self.graphs.capture_all()

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """:meth:`run_step`, in deterministic mode when the engine asks for it."""
        with batch_invariant.deterministic_mode(self.deterministic), frozen_weights(self.weights_epoch):
            return self.run_step(plan)

    @torch.inference_mode()
    def run_step(self, plan: StepPlan) -> torch.Tensor | None:
        """The logits [len(plan.logit_rows), V] of the plan's tokens (None when it asks for none);
        the pool copies must already be applied."""
        self.last_taps = None
        if (self.graphs is not None and len(plan.query_lens) <= self.graphs.max_bs and plan.is_decode
                and not plan.tap_layers):
            hidden = self.graphs.run(plan.page_tables, plan.state_slots, plan.token_ids, plan.cached_lens)
        else:
            cache = PoolCacheView(self.storage, plan.state_slots, plan.page_tables, plan.query_lens, plan.cached_lens)
            fb = ForwardBatch(query_lens=plan.query_lens, cached_lens=plan.cached_lens, cache=cache,
                              verify=self._verify_layout(plan), tap_layers=tuple(plan.tap_layers))
            images = self._image_embeds(plan.images, fb)
            hidden = self.model(torch.tensor(plan.token_ids, dtype=torch.long, device=self.device), fb, images)
            if plan.tap_layers:
                rows = torch.tensor(plan.tap_rows, dtype=torch.long, device=self.device)
                self.last_taps = torch.cat([fb.taps[t][rows] for t in plan.tap_layers], dim=-1)
        if not plan.logit_rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(plan.logit_rows, device=self.device)])

    def _verify_layout(self, plan: StepPlan) -> VerifyLayout | None:
        """The model's view of the plan's drafted chains (None without any)."""
        if not plan.chains:
            return None
        layout = VerifyLayout(seqs=list(plan.chains), method=plan.verify_method)
        if plan.verify_method == SWAP:
            layout.slots = dict(zip(plan.chains, plan.chain_slots))
        else:
            layout.window = ReplayWindow(self.storage, self.model.config)
            layout.window.blocks = dict(zip(plan.chains, plan.chain_slots))
        return layout

    def image_embeds(self, item: ImageItem) -> torch.Tensor:
        """One image's placeholder embeddings [num_tokens, hidden]: the tower runs once per image
        hash while the encoder cache keeps it."""
        def encode() -> torch.Tensor:
            patches = item.image.patches.to(self.device)
            return self.model.embed_image(patches, item.image.grid)

        return self.encoder_cache.get_or_compute(item.image.hash, encode)

    def _image_embeds(self, spans: list[ImageSpan], fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions in the flat run, embeddings) of the image placeholders this step computes:
        each chunk takes the rows of its part of an image's span, so a chunk boundary anywhere
        inside an image gives the same embeddings as one chunk."""
        if not spans:
            return None
        positions: list[int] = []
        parts: list[torch.Tensor] = []
        for s in spans:
            parts.append(self.image_embeds(s.item)[s.lo - s.item.offset : s.hi - s.item.offset])
            start = fb.cu_seqlens[s.seq] + s.lo - fb.cached_lens[s.seq]
            positions.extend(range(start, start + s.hi - s.lo))
        return torch.tensor(positions, dtype=torch.long, device=self.device), torch.cat(parts)
