"""The speculation loop around an engine step: propose -> verify -> accept -> commit.

1. After the scheduler built the step, :meth:`SpecDecoder.extend` turns plain decodes into
   chains (the last committed token + up to k drafted tokens) where the drafter has a guess and
   the chain's extra memory is available now (free or evictable cache memory), in the steps the
   cost policy picks (:mod:`tidal.spec.policy`: where chains commit tokens faster than plain
   decoding, measured per batch size; the engine reports each step's time with
   :meth:`SpecDecoder.record_step`). A draft that carries the drafter's confidences is cut
   where the chance of the target reaching the next token falls below what a verified position
   costs at the step's batch size (:meth:`CostPolicy.min_confidence`), the drafter's chance
   corrected by how often the target reached such positions lately (:mod:`tidal.spec.calibration`).
   A request held to a plain grammar has its draft cut before the first token the grammar
   rejects, and keeps each chain position's mask for its verify (:mod:`tidal.spec.grammar_draft`).
   Where the policy has decided chains lose, plain steps do next to nothing speculative: a
   hidden-state drafter makes no shadow drafts there, and steps far from the next probe ask the
   forward for no hidden states for the drafter (:mod:`tidal.spec.context_gaps`).
2. The step plan carries each chain's state slots (:meth:`ChainMemory.slots`); the worker's
   runner runs chains with the decode numerics (:mod:`tidal.spec.verify`) beside the
   step's decodes and prefills, and returns every chain position's logits.
3. :meth:`SpecDecoder.accept` picks each chain's committed tokens (:mod:`tidal.spec.accept`);
   the engine appends them one by one (stop tokens, stop strings and max_tokens end a request
   inside a chain exactly where plain decode would).
4. :meth:`SpecDecoder.commit` leaves each request with the state and pages of its committed
   tokens (:mod:`tidal.spec.rollback`) before finished requests hand them to the prefix cache.
"""

from __future__ import annotations

import math
import os
import time

import torch

from tidal.cache.allocator import PoolAllocator
from tidal.config import ModelConfig
from tidal.engine.request import Request
from tidal.engine.sampler import SampleResult, SampleRow
from tidal.spec.accept import accept_chain, chain_rows
from tidal.spec.calibration import ReachCalibration, reach_of
from tidal.spec.config import SpeculativeConfig
from tidal.spec.context_gaps import ContextGaps
from tidal.spec.drafter import Draft, Drafter, NgramDrafter, confident_prefix, propose_all
from tidal.spec.grammar_draft import FrozenMask, grammar_cut, masked_probs, speculable
from tidal.spec.metrics import SpecMetrics
from tidal.spec.policy import CostPolicy, RequestBackoff, bucket_of
from tidal.spec.rollback import ChainMemory


# While the policy has steps decode plainly, one request drafts without verifying (a shadow draft:
# its acceptance keeps the policy's estimate of the text current at the cost of a draft): after
# SHADOW_EVERY plain steps, or as many as the step has decoding sequences where that is more, the
# gap doubling with each shadow of a plain stretch up to as rarely as keeps the drafts' time to
# SHADOW_OVERHEAD of the plain steps' (drafting for one request costs about half a plain step at
# one sequence): a drafter that gets a stretch of text wrong is checked again soon, one whose
# drafts never pay costs a few percent.
SHADOW_EVERY = 4
SHADOW_OVERHEAD = 0.03
# A drafter reading the target's hidden states (DSPARK) makes no shadow drafts above one sequence
# in a bucket where chains lost (CostPolicy.chains_lost): a shadow there costs the draft and the
# window of steps before it that must hand the drafter their taps (tidal.spec.context_gaps), a few
# percent of the steps at the rarest schedule a run of requests allows, while the batch is
# compute-bound and the text rarely turns chains back on; the probes' chains measure the
# acceptance of every sequence. (An NGRAM shadow costs next to nothing and stays frequent.)


def make_drafter(config: SpeculativeConfig, vocab_size: int, dtype: torch.dtype, device: torch.device,
                 target: torch.nn.Module | None = None, max_requests: int | None = None) -> Drafter:
    """``target``: the target model in this process (DSPARK shares its embedding and LM head);
    ``max_requests``: how many requests at once a drafter keeps context for (DSPARK's cache)."""
    if config.algorithm == "NGRAM":
        return NgramDrafter(config.ngram_max_match, config.ngram_min_match)
    if config.algorithm == "STANDALONE":
        from tidal.spec.standalone import StandaloneDrafter

        assert config.draft_model_path is not None
        return StandaloneDrafter.from_path(config.draft_model_path, vocab_size, dtype, device)
    if config.algorithm == "DSPARK":
        from tidal.spec.dspark import DEFAULT_CONTEXT_REQUESTS, DsparkConfig, DsparkDrafter

        assert config.draft_model_path is not None
        if target is None or next(target.parameters()).device.type == "meta":
            raise ValueError("speculative_algorithm DSPARK needs the target model in the engine's process "
                             "(tp_size, ep_size and dcp_size 1)")
        if config.default_num_draft_tokens and os.path.isdir(config.draft_model_path):
            config.num_draft_tokens = min(config.num_draft_tokens, DsparkConfig.read(config.draft_model_path).block_size)
        return DsparkDrafter.from_path(config.draft_model_path, target, config.num_draft_tokens,
                                       max_requests or DEFAULT_CONTEXT_REQUESTS)
    raise ValueError(f"speculative_algorithm {config.algorithm} is not implemented")


def shadow_interval(num_decodes: int, draft_seconds: float, step_seconds: float, nth: int = 0) -> int:
    """Plain steps from a plain stretch's ``nth`` shadow draft (0: its first) to the next:
    SHADOW_EVERY or one a sequence, doubled ``nth`` times, at most as many as keep a draft of
    ``draft_seconds`` within SHADOW_OVERHEAD of steps of ``step_seconds`` (0: not measured yet)."""
    least = max(SHADOW_EVERY, num_decodes)
    rare = math.ceil(draft_seconds / (SHADOW_OVERHEAD * step_seconds)) if step_seconds > 0 else 0
    return max(least, min(least << min(nth, 20), rare))


def decoding_count(batch) -> int:
    """The step's sequences that decode (one new token, or a chain)."""
    return sum(1 for b, n in enumerate(batch.query_lens) if n == 1 or b in batch.drafts)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, pool: PoolAllocator, model_config: ModelConfig,
                 dtype: torch.dtype, device: torch.device, drafter: Drafter | None = None,
                 target: torch.nn.Module | None = None) -> None:
        self.config = config
        self.pool = pool
        self.vocab_size = model_config.vocab_size
        self.drafter = drafter if drafter is not None else make_drafter(config, self.vocab_size, dtype, device, target)
        # A drafter conditioned on the target's hidden states (DSPARK) names the layers it reads and
        # how many trailing positions of each sequence's step it needs; the step plan asks for them.
        self.tap_layers: tuple[int, ...] = tuple(getattr(self.drafter, "tap_layers", ()))
        self.tap_window: int = int(getattr(self.drafter, "tap_window", 0)) if self.tap_layers else 0
        # plain steps of lost buckets that tap nothing, and the requests they left waiting to draft
        self.gaps = ContextGaps(self.tap_window)
        self._tapping = True  # whether the step being built asks for the taps (plan_taps)
        self._cut_all = False  # whether a draft of the step being built was cut whole by confidence
        self._prefill, self._decodes = False, 0  # the step being built: prefill work, decoding sequences
        self.memory = ChainMemory(pool, model_config, config.rollback)
        self.metrics = SpecMetrics(config.num_draft_tokens)
        self.policy = CostPolicy() if config.adaptive else None
        # request id -> (request, its length, drafts, decoding sequences of the step, how many of the
        # drafts a chain would verify, the drafts' predicted reach)
        self._shadows: dict[str, tuple[Request, int, list[int], int, int, list[float]]] = {}
        self._plain_steps = 0
        self._next_shadow = SHADOW_EVERY
        self._shadow_seconds = 0.0  # the last shadow draft's time
        self._plain_seconds = 0.0  # the last decode-only plain step's time
        # per batch-size bucket: shadow drafts since the policy last chose chains there (chains in
        # another bucket, e.g. a lone request at the end of a batch, leave a plain stretch going)
        self._stretch_shadows: dict[int, int] = {}
        # which requests draft in a speculating step (pauses after mostly rejected chains)
        self.backoff = RequestBackoff(config.min_accept_rate)
        # the confidence cut on the reach the target was measured to give (tidal.spec.calibration),
        # and the predicted reach of each verifying chain's drafts until its commit
        self.calibration = ReachCalibration()
        self._reach: dict[str, list[float]] = {}
        # a constrained request's verifying chain: each position's grammar mask, until its accept
        self._masks: dict[str, list[FrozenMask]] = {}

    def extend(self, batch, budget: int) -> None:
        """Give decodes of the scheduled ``batch`` their drafts (``batch.drafts``), growing their
        query to the chain, within ``budget`` extra tokens and the memory the pool has available."""
        cfg = self.config
        self._tapping = True
        self._cut_all = False
        # the step as scheduled, for record_step (chains replace decodes, one for one)
        self._prefill = prefill = any(n > 1 for n in batch.query_lens)  # before any chain: only prefills are longer
        self._decodes = num_decodes = decoding_count(batch)
        if cfg.max_spec_batch and len(batch.requests) > cfg.max_spec_batch:
            return
        if self.policy is not None:
            self._score_shadows()
            if not self.policy.speculate(num_decodes, explore=not prefill):
                self._shadow(batch, num_decodes)
                if self.tap_layers and not prefill:
                    self._skip_taps(batch, num_decodes)
                return
            self._stretch_shadows.pop(bucket_of(num_decodes), None)
        asks, where, waiting = [], [], False
        for i, (req, n, c) in enumerate(zip(batch.requests, batch.query_lens, batch.cached_lens)):
            if budget <= 0:
                break
            if n != 1 or c != req.num_tokens - 1 or not (req.constraint is None or speculable(req.constraint)):
                continue
            k = min(cfg.num_draft_tokens, req.max_tokens - req.num_output_tokens - 1, budget)
            if k < 1:
                continue
            if not self.backoff.allows(req.request_id):
                continue
            if not self.gaps.complete(req):
                waiting = True
                continue
            asks.append((req.request_id, req.token_ids, k))
            where.append((i, req, c, k))
            budget -= k
        if waiting and not asks and self.policy is not None:  # a probe that came before the taps did
            self.policy.defer_probe(num_decodes)
        least = self.policy.min_confidence(num_decodes) if self.policy is not None else 0.0
        drafts = propose_all(self.drafter, asks, least) if asks else []
        for (i, req, c, k), draft in zip(where, drafts):
            if draft is None:
                continue
            tokens = draft.tokens[: min(k, self.calibration.prefix(draft, least))]
            if not tokens:  # the confidence cut left nothing (the drafting was paid for)
                self._cut_all = True
                continue
            if any(not 0 <= t < self.vocab_size for t in tokens):
                raise ValueError(f"the drafter proposed a token outside the vocabulary: {tokens}")
            masks = None
            if req.constraint is not None:  # cut where the grammar rejects (the matcher is left as it was)
                drafted = len(tokens)
                tokens, masks = grammar_cut(req.constraint, tokens, self.vocab_size)
                if not tokens:  # a draft the grammar rejects whole: backs off as a rejected chain would
                    self.backoff.record(req.request_id, drafted, 0)
                    continue
            if not self.memory.acquire(req.request_id, c, 1 + len(tokens)):
                continue
            probs = draft.probs[: len(tokens)] if draft.probs is not None else None
            if masks is not None:
                self._masks[req.request_id] = masks
                if probs is not None:
                    probs = masked_probs(probs, masks)
            conf = draft.confidence[: len(tokens)] if draft.confidence is not None else None
            batch.drafts[i] = Draft(tokens, probs, conf)
            if conf is not None:
                self._reach[req.request_id] = reach_of(batch.drafts[i])
            batch.query_lens[i] = 1 + len(tokens)
        if batch.drafts:
            batch.chain_memory = self.memory

    def _shadow(self, batch, n: int) -> None:
        """Now and then (SHADOW_EVERY) in a plain step of ``n`` decoding sequences, draft for one
        decoding request (in turn) without verifying; :meth:`_score_shadows` counts what the target
        then produced."""
        self._plain_steps += 1
        if self._plain_steps < self._next_shadow:
            return
        if self.tap_layers and self.policy.chains_lost(n):
            return  # none here (see above); one is due as soon as the batch leaves the bucket
        nth = self._stretch_shadows.get(bucket_of(n), 0)
        self._next_shadow = self._plain_steps + shadow_interval(n, self._shadow_seconds, self._plain_seconds, nth)
        self._stretch_shadows[bucket_of(n)] = nth + 1
        cands = [r for r, q, c in zip(batch.requests, batch.query_lens, batch.cached_lens)
                 if q == 1 and c == r.num_tokens - 1 and (r.constraint is None or speculable(r.constraint))
                 and r.request_id not in self._shadows and self.gaps.complete(r)]
        k = self.config.num_draft_tokens
        if not cands:
            return
        req = cands[self._plain_steps % len(cands)]
        k = min(k, req.max_tokens - req.num_output_tokens - 1)
        if k < 1:
            return
        least = self.policy.min_confidence(n)  # a speculative step would verify the prefix sure enough
        start = time.perf_counter()
        draft = propose_all(self.drafter, [(req.request_id, req.token_ids, k)], least)[0]
        self._shadow_seconds = time.perf_counter() - start
        # Scored on the drafter's own cut, not the calibrated one: positions the calibrated cut
        # stopped verifying keep being measured, so a factor fallen on one stretch of text can rise again.
        raw = draft.tokens[: min(k, confident_prefix(draft, least))] if draft is not None else []
        if raw and req.constraint is not None:  # a chain would verify only what the grammar allows
            raw = grammar_cut(req.constraint, raw, self.vocab_size)[0]
        if not raw:
            self.policy.record_shadow(n, 1)  # a speculative step would commit its one token
            return
        reach = reach_of(draft)[: len(raw)]
        self._shadows[req.request_id] = (req, req.num_tokens, list(raw), n,
                                         min(len(raw), self.calibration.prefix(draft, least)), reach)

    def _skip_taps(self, batch, n: int) -> None:
        """A decode-only plain step asks for no taps where chains lost (no shadow drafts there) and
        the next probe is more than two windows of steps away (its distance follows the estimates)
        (:mod:`tidal.spec.context_gaps`)."""
        w = self.tap_window
        if self.policy.steps_before_probe(n) <= 2 * w:  # (0 where chains did not lose)
            return
        self._tapping = False
        self.gaps.skip(batch.requests, batch.cached_lens)

    def plan_taps(self) -> tuple[tuple[int, ...], int]:
        """(tap layers, tap window) the step built by :meth:`extend` asks the forward for."""
        return (self.tap_layers, self.tap_window) if self._tapping else ((), 0)

    def _score_shadows(self) -> None:
        """Shadow drafts whose positions the target has produced since (or whose request ended):
        the tokens a chain would have committed (the drafts up to the first miss, plus one)."""
        for rid, (req, start, tokens, num_decodes, verified, reach) in list(self._shadows.items()):
            got = req.token_ids[start : start + len(tokens)]
            if len(got) < len(tokens) and not req.finished:
                continue
            accepted = 0
            for a, b in zip(got, tokens):
                if a != b:
                    break
                accepted += 1
            del self._shadows[rid]
            if reach[: len(got)]:  # (a request that ended inside the drafts measured their prefix)
                self.calibration.record(reach[: len(got)], accepted)
            self.policy.record_shadow(num_decodes, min(accepted, verified) + 1)

    def record_step(self, batch, seconds: float, tokens: int) -> None:
        """The engine's measurement of a step (``seconds`` from before :meth:`extend` to its
        tokens committed): only steps without prefill work inform the policy."""
        if self.policy is None or self._prefill:
            return
        # Above one sequence, a step whose drafts were cut whole by the confidence cut (nothing sure
        # enough to verify, as at 32 sequences) is a speculative step: it paid for drafting, and
        # counted as plain it kept the policy exploring chains that never came, drafting in every
        # step. (A drafter with no guess, NGRAM without a match, did next to no work: that step
        # stays plain; so does a lone sequence's, whose accounting is left as it was.)
        n = self._decodes
        speculated = bool(batch.drafts) or (self._cut_all and n > 1)
        if not speculated:
            self._plain_seconds = seconds
        self.policy.record(n, speculated, seconds, tokens)

    def accept(self, req: Request, draft: Draft, logits: torch.Tensor) -> list[SampleResult]:
        """The committed tokens of ``req``'s chain (logits [m, V] of its positions)."""
        p = req.params
        eos = () if p.ignore_eos else tuple(req.eos_token_ids)
        row = SampleRow(p, req.generator, (), req.token_ids, req.num_prompt_tokens, None)
        rows = chain_rows(row, draft.tokens, eos + tuple(p.stop_token_ids or ()), req.num_output_tokens,
                          p.min_tokens, self._masks.pop(req.request_id, None))
        return accept_chain(logits, draft.tokens, draft.probs, rows)

    def observe(self, items: list[tuple[str, int, torch.Tensor]]) -> None:
        """Hand the drafter the target's tapped hidden states of committed positions: (request id,
        first position, rows) per request, in one call where the drafter batches them."""
        many = getattr(self.drafter, "observe_many", None)
        if many is not None:
            many(items)
            return
        for item in items:
            self.drafter.observe(*item)  # type: ignore[attr-defined]

    def observe_decodes(self, request_ids: list[str], positions: list[int], rows: torch.Tensor) -> None:
        """:meth:`observe` for plain decodes, one committed position each: request ``request_ids[i]``'s
        position ``positions[i]`` has the tapped states ``rows[i]`` (the step's decodes in one tensor,
        not a slice per request: a step that does not speculate pays little for keeping the context)."""
        fast = getattr(self.drafter, "observe_decodes", None)
        if fast is not None:
            fast(request_ids, positions, rows)
            return
        self.observe([(rid, pos, rows[i : i + 1]) for i, (rid, pos) in enumerate(zip(request_ids, positions))])

    def commit(self, chains: list[tuple[Request, int, int, int, int]],
               taps: dict[str, torch.Tensor] | None = None) -> None:
        """``chains``: (request, tokens it had computed before the step, drafts, drafts accepted,
        tokens it appended). Each request keeps the state after its last computed position and
        the pages of its tokens; the metrics count the chain. ``taps`` (request id -> tapped hidden
        states of every chain position): the drafter sees only the committed positions' rows."""
        if taps:
            self.observe([(req.request_id, cached, taps[req.request_id][:appended])
                          for req, cached, _, _, appended in chains if req.request_id in taps])
        self.memory.commit({req.request_id: appended - 1 for req, _, _, _, appended in chains})
        for req, cached, drafted, accepted, appended in chains:
            req.num_computed_tokens = cached + appended
            self.pool.truncate(req.request_id, req.num_computed_tokens + 1)
            self.metrics.record(drafted, accepted, appended)
            self.backoff.record(req.request_id, drafted, accepted)
            reach = self._reach.pop(req.request_id, None)
            if reach:
                self.calibration.record(reach, accepted)

    def forget(self, request_id: str) -> None:
        shadow = self._shadows.get(request_id)
        if shadow is not None and self.policy is not None:
            self._score_shadows()  # a finished request's shadow is scored with what it produced
        self._shadows.pop(request_id, None)
        self.memory.release(request_id)
        self._reach.pop(request_id, None)
        self._masks.pop(request_id, None)
        self.backoff.forget(request_id)
        self.gaps.forget(request_id)
        self.drafter.forget(request_id)

    def release_all(self) -> None:
        """After a failed step: free every chain's extra memory."""
        self.memory.release_all()
        self._reach.clear()
        self._masks.clear()
