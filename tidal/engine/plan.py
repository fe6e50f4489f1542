"""The step plan: everything a worker needs to run one engine step, and nothing it must look up.

The engine core schedules a step, lets the allocator place it (state blocks, pages, copies), and
writes a :class:`StepPlan`: the flat run of new tokens, each sequence's cached length, state slot
and page table, the pool copies recorded since the last plan, and which rows of the run it wants
logits for. A worker (:mod:`tidal.engine.worker`) applies the copies to its pool storage, runs the
model and returns those rows' logits. The plan holds plain ints, so it is one message that can be
broadcast to every rank's worker (``encode_plan`` / ``decode_plan``, msgpack), and replaying the
plans of a run into a fresh worker reproduces its storage and its logits exactly.

A sequence may bring any number of new tokens and ask for logits at any of them: a prefill chunk
asks for its last row, a decode step for its one row, and a verify step of speculative decoding
(k drafted tokens + 1) for all k + 1 rows. Positions are ``cached_lens[b] + i`` for the i-th new
token of sequence b.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from tidal.cache.allocator import CopyPages, CopyState, PoolAllocator, PoolCopy, ReplayStates, ZeroState
from tidal.engine.request import ImageItem
from tidal.engine.scheduler import ScheduledBatch


@dataclass(frozen=True)
class ImageSpan:
    """Image ``item``'s placeholder tokens ``lo .. hi-1`` (prompt positions) are in sequence ``seq``'s
    new tokens this step. Carries pixels: only an in-process worker takes them (see encode_plan)."""

    seq: int
    lo: int
    hi: int
    item: ImageItem


@dataclass
class StepPlan:
    """One step, sequences in the order the model runs them (decodes first, by state slot: the
    KDA states of a decode batch then sit side by side in the pool, see ``ForwardBatch.decode_runs``)."""

    step: int  # 1-based; a worker takes plans in order
    copies: list[PoolCopy]  # apply before the model runs, in order
    token_ids: list[int]  # the new tokens of every sequence, concatenated
    query_lens: list[int]
    cached_lens: list[int]
    state_slots: list[int]  # each sequence's state block
    page_tables: list[list[int]]  # each sequence's pages for its cached + new tokens
    logit_rows: list[int]  # rows of token_ids whose logits come back, in this order
    images: list[ImageSpan] = field(default_factory=list)
    # Speculative verify (tidal.spec.verify): the sequences (plan order) whose tokens are a drafted
    # chain, and per chain its state slot of each position ("swap") or its replay window blocks
    # ("replay"); ``verify_method`` is "" when the step has no chain.
    verify_method: str = ""
    chains: list[int] = field(default_factory=list)
    chain_slots: list[list[int]] = field(default_factory=list)
    # DSPARK (tidal.spec.dspark): the target layers whose hidden states come back for the rows
    # ``tap_rows`` of the run (each sequence's last new tokens), concatenated per row.
    tap_layers: list[int] = field(default_factory=list)
    tap_rows: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


@dataclass
class StepLogits:
    """The plan's logits mapped back to the scheduled batch: one row per sampling request, plus
    prompt-logprob rows."""

    sample_seqs: list[int] = field(default_factory=list)  # batch positions that sample a token
    sample_logits: torch.Tensor | None = None  # [len(sample_seqs), V]
    # batch position -> (prompt positions t, logits [len(t), V] scoring prompt token t+1)
    prompt: dict[int, tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    # Speculation: batch position -> logits [chain length, V] of every chain position.
    chains: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class LogitMap:
    """Core-side: what each of the plan's logit rows is for (never sent to a worker)."""

    sample_seqs: list[int]
    prompt: list[tuple[int, list[int], int]]  # (batch position, prompt positions, first row)
    first_sample: int
    chains: list[tuple[int, int, int]] = field(default_factory=list)  # (batch position, first row, length)
    first_chain: int = -1
    # (batch position, position of its first tapped token, tapped tokens, first row of the taps)
    taps: list[tuple[int, int, int, int]] = field(default_factory=list)

    def split(self, logits: torch.Tensor | None) -> StepLogits:
        out = StepLogits(sample_seqs=list(self.sample_seqs))
        if logits is None:
            return out
        first_chain = self.first_chain if self.first_chain >= 0 else logits.shape[0]
        if self.sample_seqs:
            out.sample_logits = logits[self.first_sample:first_chain]
        for b, positions, start in self.prompt:
            out.prompt[b] = (positions, logits[start : start + len(positions)])
        for b, start, m in self.chains:
            out.chains[b] = logits[start : start + m]
        return out


def plan_step(step: int, batch: ScheduledBatch, pool: PoolAllocator, tap_layers: tuple[int, ...] = (),
              tap_window: int = 0) -> tuple[StepPlan, LogitMap]:
    """The plan of a scheduled batch whose requests hold their blocks and pages (the scheduler
    reserved them, and ``batch.chain_memory`` the chains' extra memory); takes the allocator's
    pending copies. A chain's tokens are its last committed token and its drafts. With
    ``tap_layers``, the last ``tap_window`` new tokens of every sequence (a chain's whole chain)
    have those layers' hidden states returned."""
    order = sorted(range(len(batch.requests)),
                   key=lambda b: (batch.query_lens[b] > 1, pool.state_block(batch.requests[b].request_id)))
    plan = StepPlan(step=step, copies=pool.take_copies(), token_ids=[], query_lens=[], cached_lens=[],
                    state_slots=[], page_tables=[], logit_rows=[])
    cu = [0]
    for i, b in enumerate(order):
        req, n, c = batch.requests[b], batch.query_lens[b], batch.cached_lens[b]
        rid = req.request_id
        draft = batch.drafts.get(b)
        plan.token_ids.extend(req.token_ids[c : c + n] if draft is None else [req.token_ids[c], *draft.tokens])
        if draft is not None:
            plan.verify_method = batch.chain_memory.method
            plan.chains.append(i)
            plan.chain_slots.append(batch.chain_memory.slots(rid))
        plan.query_lens.append(n)
        plan.cached_lens.append(c)
        plan.state_slots.append(pool.state_block(rid))
        plan.page_tables.append(pool.page_table(rid)[: pool.pages_for(c + n)])
        cu.append(cu[-1] + n)
        for item in req.images:
            lo, hi = max(c, item.offset), min(c + n, item.end)
            if lo < hi:
                plan.images.append(ImageSpan(i, lo, hi, item))
    prompt: list[tuple[int, list[int], int]] = []
    for i, b in enumerate(order):
        req, n, c = batch.requests[b], batch.query_lens[b], batch.cached_lens[b]
        positions = req.prompt_logprob_positions(c, n)
        if positions:
            prompt.append((b, positions, len(plan.logit_rows)))
            plan.logit_rows.extend(cu[i] + t - c for t in positions)
    first_sample = len(plan.logit_rows)
    sample_seqs = []
    for i, b in enumerate(order):
        req, n, c = batch.requests[b], batch.query_lens[b], batch.cached_lens[b]
        if c + n == req.num_tokens:
            sample_seqs.append(b)
            plan.logit_rows.append(cu[i + 1] - 1)
    logit_map = LogitMap(sample_seqs, prompt, first_sample)
    if plan.chains:
        logit_map.first_chain = len(plan.logit_rows)
        for i in plan.chains:
            logit_map.chains.append((order[i], len(plan.logit_rows), plan.query_lens[i]))
            plan.logit_rows.extend(range(cu[i], cu[i + 1]))
    if tap_layers:
        plan.tap_layers = list(tap_layers)
        for i, b in enumerate(order):
            n, c = plan.query_lens[i], plan.cached_lens[i]
            t = n if b in batch.drafts else min(n, tap_window)
            logit_map.taps.append((b, c + n - t, t, len(plan.tap_rows)))
            plan.tap_rows.extend(range(cu[i + 1] - t, cu[i + 1]))
    return plan, logit_map


# ---- wire format ---------------------------------------------------------------------------------
_COPY_TAGS = {ZeroState: "zero", CopyState: "state", CopyPages: "pages", ReplayStates: "replay"}
_COPY_TYPES = {tag: cls for cls, tag in _COPY_TAGS.items()}


def _copy_to_wire(c: PoolCopy) -> list[Any]:
    return [_COPY_TAGS[type(c)], *(getattr(c, f.name) for f in dataclasses.fields(c))]


def encode_plan(plan: StepPlan) -> bytes:
    """The plan as one msgpack message (the same bytes for every rank)."""
    if plan.images:
        raise ValueError("a step plan with images runs only on an in-process worker (pixels do not travel)")
    return msgpack.packb([plan.step, [_copy_to_wire(c) for c in plan.copies], plan.token_ids, plan.query_lens,
                          plan.cached_lens, plan.state_slots, plan.page_tables, plan.logit_rows,
                          plan.verify_method, plan.chains, plan.chain_slots, plan.tap_layers, plan.tap_rows])


def decode_plan(data: bytes) -> StepPlan:
    step, copies, ids, q, c, slots, tables, rows, method, chains, chain_slots, taps, tap_rows = msgpack.unpackb(data)
    return StepPlan(step=step, copies=[_COPY_TYPES[w[0]](*w[1:]) for w in copies], token_ids=ids, query_lens=q,
                    cached_lens=c, state_slots=slots, page_tables=tables, logit_rows=rows,
                    verify_method=method, chains=chains, chain_slots=chain_slots, tap_layers=taps, tap_rows=tap_rows)
