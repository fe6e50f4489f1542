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

The running-request cap is the pool -- every running request holds a state block -- and, when
set, ``max_running_requests`` (admission stops there). The oldest running
request is never preempted while another runs, and any request accepted by the engine fits the
pool alone, so the oldest always progresses: no livelock, and nothing ever fails for memory.

With a prefix cache (:mod:`tidal.cache.prefix`), admission first looks the request up: a hit
shares the cached pages and copies the snapshot's state (or, when a second block does not fit,
takes the snapshot out of the cache), and prefill starts after it -- never past the last token,
whose logits are sampled, nor past a prompt-logprob position still to score. After a prefill
chunk that brings the request ``snapshot_interval`` or more tokens past its last snapshot (or
its hit) the engine snapshots the state (:meth:`Scheduler.snapshot`); chunks are never cut for
it, so a small interval never shrinks them below the step budget. Finished and preempted requests hand their computed prefix and
state to the cache (aborted ones do not: their memory is freed at once). Cache memory is
evictable and every capacity check counts it as free, so the guarantees above hold unchanged: a
hit that does not fit is retried without it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tidal.cache.allocator import PoolAllocator
from tidal.cache.prefix import PrefixCache, PrefixHit
from tidal.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """The step's requests in batch order, with the new tokens and cached tokens of each."""

    requests: list[Request] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    cached_lens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    new_requests: list[Request] = field(default_factory=list)  # admitted for the first time
    # Speculation (tidal.spec.decoder): batch position -> its drafted tokens (the query is the
    # last committed token + these), and the memory of those chains.
    drafts: dict[int, Any] = field(default_factory=dict)
    chain_memory: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self, pool: PoolAllocator, max_num_batched_tokens: int, prefix_cache: PrefixCache | None = None,
        *, max_running_requests: int | None = None,
    ) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if prefix_cache is not None and prefix_cache.pool is not pool:
            raise ValueError("the prefix cache lives in another pool")
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.max_running_requests = max_running_requests  # None: the pool is the only cap
        self.snapshot_interval = prefix_cache.snapshot_interval if prefix_cache is not None else 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.num_preemptions = 0
        self.recomputed_tokens = 0
        self.prefix_queries = 0  # prompt tokens looked up at first admission
        self.prefix_hits = 0  # of those, tokens served from the cache
        self._lost: dict[str, int] = {}  # preempted request -> tokens it had computed
        self._snapshot_at: dict[str, int] = {}  # running request -> depth of its last snapshot or hit

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
        self._lost.pop(request.request_id, None)
        self._snapshot_at.pop(request.request_id, None)
        self.pool.free(request.request_id)

    def finish(self, request: Request) -> None:
        """Like :meth:`remove`, for a request that ended normally: its computed tokens and state
        go to the prefix cache first (the next turn of a conversation resumes there)."""
        self._to_cache(request)
        self.remove(request)

    def snapshot_due(self, request: Request, cached: int, n: int) -> bool:
        """Whether the state after this step's chunk ``[cached, cached + n)`` is to be cached: at
        the end of a prefill (of the prompt, or a recompute) and inside one once the chunk ends
        ``snapshot_interval`` or more tokens past the last snapshot."""
        if self.prefix_cache is None:
            return False
        end = cached + n
        prefill = n > 1 or end < request.num_tokens
        interval = self.snapshot_interval
        since = end - self._snapshot_at.get(request.request_id, 0)
        return prefill and (end == request.num_tokens or end == request.fork_depth
                            or (interval > 0 and since >= interval))

    def snapshot(self, request: Request) -> bool:
        """Cache the running ``request``'s computed tokens with a copy of its state."""
        if self.prefix_cache is None or request.num_computed_tokens == 0:
            return False
        self._snapshot_at[request.request_id] = request.num_computed_tokens
        return self.prefix_cache.insert(request.cache_key(request.num_computed_tokens), request.request_id)

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
                n = self._chunk(req, req.num_computed_tokens, min(req.num_uncomputed, budget - decodes_left))
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

    def _chunk(self, req: Request, start: int, n: int) -> int:
        """A prefill chunk of ``n`` tokens from ``start``, ended at the request's fork depth when
        it crosses it (the state there is snapshotted for the request's siblings)."""
        fork = req.fork_depth
        if self.prefix_cache is not None and fork is not None and start < fork < start + n:
            n = fork - start
        return n

    def _fit_running(self, req: Request, n: int, decode: bool, batch: ScheduledBatch) -> int:
        """Reserve pages for n new tokens of a running request, shrinking a prefill chunk or
        preempting the newest requests; 0 when ``req`` itself had to go."""
        pool, rid = self.pool, req.request_id
        while not pool.reserve(rid, req.num_computed_tokens + n):
            if not decode:
                held = len(pool.page_table(rid)) + pool.available_pages
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
        cap = self.max_running_requests
        while self.waiting and budget > 0 and (cap is None or len(self.running) < cap):
            req = self.waiting[0]
            hit = self._lookup(req)
            n = 0
            if hit is not None:  # copy the snapshot; when that does not fit, take it
                n = self._start(req, hit, budget) or self._start(req, hit, budget, take=True)
            if n == 0:
                hit = None
                n = self._start(req, None, budget)
            if n == 0:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            depth = hit.depth if hit is not None else 0
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = depth
                batch.new_requests.append(req)
                if self.prefix_cache is not None:
                    self.prefix_queries += req.num_prompt_tokens
                    self.prefix_hits += depth
            else:
                self.recomputed_tokens += max(0, self._lost.pop(req.request_id, 0) - depth)
            self._add(batch, req, n)
            budget -= n

    def _lookup(self, req: Request) -> PrefixHit | None:
        """The cache hit for a waiting request: at most all tokens but the last (its logits are
        sampled), and no further than the prompt logprobs already recorded."""
        if self.prefix_cache is None:
            return None
        limit = req.num_tokens - 1
        if req.prompt_logprobs is not None:
            limit = min(limit, len(req.prompt_logprobs) - 1)
        if limit <= 0:
            return None
        return self.prefix_cache.match(req.cache_key(), limit)

    def _start(self, req: Request, hit: PrefixHit | None, budget: int, take: bool = False) -> int:
        """Give a waiting request its state (zeros, or the hit's snapshot: copied, or taken from
        the cache when ``take`` -- one block less), the hit's pages and pages for its first chunk;
        returns that chunk's length, 0 (nothing held) when it does not fit."""
        pool, rid, cache = self.pool, req.request_id, self.prefix_cache
        depth = hit.depth if hit is not None else 0
        n = self._chunk(req, depth, min(req.num_tokens - depth, budget))
        copy_last = hit is not None and depth % pool.page_size != 0
        need = (0 if take else pool.pages_per_block) + pool.pages_for(depth + n) + int(copy_last)
        if hit is not None:
            assert cache is not None
            need -= len(hit.pages)
            cache.pin(hit.node)  # its snapshot and pages are not evictable now
        if need > pool.available_pages:
            if cache is not None:
                cache.unpin()
            return 0
        if hit is not None:
            pool.share(rid, hit.pages)
        ok = pool.make_room(need)
        if cache is not None:
            cache.unpin()
        # Room is made: nothing below evicts, so the hit's snapshot is still there.
        if hit is None:
            ok = ok and pool.alloc_state(rid)
        elif take:
            cache.take_snapshot(hit.node, rid)
        else:
            ok = ok and pool.alloc_state(rid, zero=False)
            pool.copy_state(hit.node, rid)
            cache.touch(hit.node)
        if copy_last:
            ok = ok and pool.unshare_last_page(rid)
        ok = ok and pool.reserve(rid, depth + n)
        if not ok:  # cannot happen: available_pages is exact
            raise RuntimeError(f"admitting {rid!r}: {need} page units were available but did not fit")
        req.num_computed_tokens = depth
        self._snapshot_at[rid] = depth
        return n

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self._to_cache(req)
        self.pool.free(req.request_id)
        self._lost[req.request_id] = req.num_computed_tokens
        self._snapshot_at.pop(req.request_id, None)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.preempted.append(req)
        self.num_preemptions += 1

    def _to_cache(self, req: Request) -> None:
        """Hand a leaving request's computed prefix and state block to the prefix cache."""
        k = req.num_computed_tokens
        if self.prefix_cache is not None and k > 0 and self.pool.has_state(req.request_id):
            self.prefix_cache.insert(req.cache_key(k), req.request_id, move_state=True)

    @staticmethod
    def _add(batch: ScheduledBatch, req: Request, n: int) -> None:
        batch.requests.append(req)
        batch.query_lens.append(n)
        batch.cached_lens.append(req.num_computed_tokens)
