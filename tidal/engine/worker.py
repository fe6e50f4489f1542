"""The worker: the weights, the pool's storage and the model runner of one rank.

It takes step plans (:mod:`tidal.engine.plan`) in order, applies each plan's pool copies to its
storage, runs the model and returns the logits rows the plan asks for. It keeps no request state:
everything it needs is in the plan, so the same plan can be broadcast to one worker per rank, and
a fresh worker fed the plans of a run from its first step ends with the same storage and logits.
"""

from __future__ import annotations

import torch

from tidal.cache.storage import PoolStorage
from tidal.engine.cuda_graph import DEFAULT_MAX_BS
from tidal.engine.plan import StepPlan
from tidal.engine.whole_choice import score_after
from tidal.engine.runner import ModelRunner
from tidal.model.kimi import KimiForCausalLM
from tidal.multimodal.encoder_cache import EncoderCache
from tidal.ops import float_mode
from tidal.plan import PoolLayout


class Worker:
    """One rank's model and pool storage (the in-process worker of ``LLM`` and the engine core)."""

    def __init__(
        self, model: KimiForCausalLM, layout: PoolLayout, encoder_cache: EncoderCache | None = None, *,
        cuda_graph: bool = True, cuda_graph_max_bs: int = DEFAULT_MAX_BS, max_context: int | None = None,
        deterministic: bool = False, dcp_rank: int = 0,
    ) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.storage = PoolStorage(model.config, layout, model.dtype, self.device, dcp_rank=dcp_rank)
        self.runner = ModelRunner(model, self.storage, encoder_cache, cuda_graph=cuda_graph,
                                  cuda_graph_max_bs=cuda_graph_max_bs, max_context=max_context,
                                  deterministic=deterministic)
        self.last_step = 0

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Apply the plan's copies, run it; the logits of ``plan.logit_rows`` (None if none).
        The copies are applied even when the model then raises: the books already count them."""
        if plan.step != self.last_step + 1:
            raise RuntimeError(f"the worker ran step {self.last_step} and got the plan of step {plan.step}")
        self.last_step = plan.step
        self.storage.apply(plan.copies)
        if not plan.query_lens:
            return None
        if self.device.type == "cpu":  # subnormals flushed on the thread that runs the step
            float_mode.ensure_flushing()
        return self.runner.execute(plan)

    def score(self, state_block: int, pages: list[int], length: int, last_logits: torch.Tensor,
              continuations: list[list[int]]) -> list[float]:
        """Each continuation's log-probability after a sequence the pool holds (whole-name choice):
        its state block, its pages, its ``length`` tokens and its last position's logits, as the
        last step left them. Reads the storage, never writes it: each continuation runs from a copy
        (tidal.engine.whole_choice.score_after)."""
        cache = self.storage.snapshot(state_block, pages, length)
        return score_after(self.model, cache, length, last_logits, continuations)

    @property
    def last_taps(self) -> torch.Tensor | None:
        """The last plan's tapped hidden states [len(plan.tap_rows), n_taps * d] (DSPARK)."""
        return self.runner.last_taps
