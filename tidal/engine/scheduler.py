"""FCFS continuous batching with chunked prefill over the shared pool; never fails for memory.

Each step, under a token budget:

1. Running requests, oldest first: a decoding request brings its one token (always; all running
   requests decode every step), a prefilling one its next chunk (budget left after the decodes
   still to come). When the pool cannot hold a request's new tokens, a prefill chunk shrinks to
   what fits; otherwise the NEWEST running request is preempted (pages and state freed, requeued
   at the front of the waiting queue, recomputed later) until it fits — possibly the request
   itself when it is the newest.
2. Waiting requests, in arrival order, while the budget lasts and the step did not preempt: one is
   admitted only if its state block and first chunk fit now; the first that does not fit stops
   admission (FCFS).

The running-request cap is the pool: every running request holds a state block. The oldest running
request is never preempted while another runs, and any request accepted by the engine fits the
pool alone, so the oldest always progresses: no livelock, and nothing ever fails for memory.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tidal.cache.pool import MemoryPool
from tidal.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """The step's requests in batch order, with the new tokens and cached tokens of each."""

    requests: list[Request] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    cached_lens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, pool: MemoryPool, max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.num_preemptions = 0
        self.recomputed_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and free its memory at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.request_id)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        decodes_left = sum(1 for r in self.running if r.num_uncomputed == 1)
        i = 0
        while i < len(self.running):
            req = self.running[i]
            decode = req.num_uncomputed == 1
            if decode:
                decodes_left -= 1
                n = 1
            else:
                n = min(req.num_uncomputed, budget - decodes_left)
                if n <= 0:
                    i += 1
                    continue
            n = self._fit_running(req, n, decode, batch)
            if n == 0:  # req itself was preempted (it was the newest)
                break
            self._add(batch, req, n)
            budget -= n
            i += 1
        if not batch.preempted:
            self._admit(batch, budget)
        return batch

    def _fit_running(self, req: Request, n: int, decode: bool, batch: ScheduledBatch) -> int:
        """Reserve pages for n new tokens of a running request, shrinking a prefill chunk or
        preempting the newest requests; 0 when ``req`` itself had to go."""
        pool, rid = self.pool, req.request_id
        while not pool.reserve(rid, req.num_computed_tokens + n):
            if not decode:
                held = len(pool.page_table(rid)) + pool.free_pages
                fits = held * pool.page_size - req.num_computed_tokens
                if fits > 0:
                    n = min(n, fits)
                    continue
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is req:
                return 0
        return n

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        pool = self.pool
        while self.waiting and budget > 0:
            req = self.waiting[0]
            n = min(req.num_uncomputed, budget)
            if not pool.can_allocate(0, pool.units_for(req.request_id, n)):
                break
            ok = pool.alloc_state(req.request_id) and pool.reserve(req.request_id, n)
            if not ok:  # cannot happen: can_allocate is exact; stay safe and wait
                pool.free(req.request_id)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            self._add(batch, req, n)
            budget -= n

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self.pool.free(req.request_id)
        self.recomputed_tokens += req.num_computed_tokens
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.preempted.append(req)
        self.num_preemptions += 1

    @staticmethod
    def _add(batch: ScheduledBatch, req: Request, n: int) -> None:
        batch.requests.append(req)
        batch.query_lens.append(n)
        batch.cached_lens.append(req.num_computed_tokens)
