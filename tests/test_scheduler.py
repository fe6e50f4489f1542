"""Scheduler policy on a real pool, driven without a model: each step commits the scheduled
tokens and appends a token for requests that reached their end."""

from __future__ import annotations

import random

import torch

from tidal.cache.pool import MemoryPool
from tidal.engine.request import Request
from tidal.engine.scheduler import Scheduler
from tidal.plan import pool_layout
from tidal.presets import tiny_k3
from tidal.sampling_params import SamplingParams


def make(num_blocks: int, budget: int, page_size: int = 4) -> Scheduler:
    config = tiny_k3()
    probe = pool_layout(config, 1 << 30, page_size=page_size, kv_dtype_bytes=4, conv_dtype_bytes=4)
    layout = pool_layout(config, num_blocks * probe.block_bytes, page_size=page_size, kv_dtype_bytes=4,
                         conv_dtype_bytes=4)
    return Scheduler(MemoryPool(config, layout, torch.float32), budget)


def request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(1, prompt_len + 1)), params, eos_token_ids=(), max_tokens=max_tokens)


def step(s: Scheduler) -> tuple[list[tuple[str, int, int]], list[Request]]:
    """Schedule, check the step is consistent with the pool, commit; returns (rid, query, cached)
    triples and the requests that finished."""
    batch = s.schedule()
    finished = []
    for req, n, c in zip(batch.requests, batch.query_lens, batch.cached_lens):
        assert c == req.num_computed_tokens and 1 <= n <= req.num_uncomputed
        assert len(s.pool.page_table(req.request_id)) * s.pool.page_size >= c + n
        assert s.pool.has_state(req.request_id)
    for req, n in zip(batch.requests, batch.query_lens):
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(7)
            if req.finished:
                s.remove(req)
                finished.append(req)
    return [(r.request_id, n, c) for r, n, c in zip(batch.requests, batch.query_lens, batch.cached_lens)], finished


def test_chunked_prefill_and_decodes_share_the_budget():
    s = make(num_blocks=40, budget=10)
    s.add(request("a", 3, 5))
    assert step(s)[0] == [("a", 3, 0)]
    s.add(request("b", 25, 2))
    # a decodes (1 token), b prefills in chunks of the remaining budget.
    assert step(s)[0] == [("a", 1, 3), ("b", 9, 0)]
    assert step(s)[0] == [("a", 1, 4), ("b", 9, 9)]
    s.add(request("c", 4, 2))
    assert step(s)[0] == [("a", 1, 5), ("b", 7, 18), ("c", 2, 0)]
    assert step(s)[0] == [("a", 1, 6), ("b", 1, 25), ("c", 2, 2)]


def test_every_running_request_decodes_each_step_and_budget_holds():
    s = make(num_blocks=60, budget=16)
    rng = random.Random(0)
    for i in range(12):
        s.add(request(str(i), rng.randint(1, 40), rng.randint(1, 10)))
    while s.has_unfinished():
        decoding = {r.request_id for r in s.running if r.num_uncomputed == 1}
        scheduled, _ = step(s)
        ids = [rid for rid, _, _ in scheduled]
        assert decoding <= set(ids)
        assert sum(n for _, n, _ in scheduled) <= max(16, len(decoding))
    assert s.pool.usage().free_blocks == s.pool.num_blocks


def test_running_cap_is_the_pool_and_admission_is_fcfs():
    s = make(num_blocks=5, budget=1000)
    for i in range(8):
        s.add(request(str(i), 2, 3))
    scheduled, _ = step(s)
    # 2 tokens = 1 page per request; 4 states + 4 pages < 5 blocks of 10 pages: the 5th state does not fit.
    assert [rid for rid, _, _ in scheduled] == ["0", "1", "2", "3"]
    assert len(s.running) == 4 and [r.request_id for r in s.waiting] == ["4", "5", "6", "7"]
    # A huge head-of-line request blocks later small ones (FCFS), until room appears.
    s2 = make(num_blocks=5, budget=1000)
    s2.add(request("small", 2, 30))
    step(s2)
    s2.add(request("big", 130, 1))
    s2.add(request("tiny", 1, 1))
    assert [rid for rid, _, _ in step(s2)[0]] == ["small"]


def test_overload_preempts_newest_and_everything_finishes():
    s = make(num_blocks=6, budget=64)
    for i in range(16):
        s.add(request(str(i), 6, 40))
    done: list[Request] = []
    preempted_seen = 0
    start = s.pool.usage()
    while s.has_unfinished():
        running_before = [r.request_id for r in s.running]
        batch_ids, finished = step(s)
        done.extend(finished)
        newly = s.num_preemptions - preempted_seen
        if newly:
            preempted_seen = s.num_preemptions
            # Victims are the newest running requests: the front of the waiting queue now.
            victims = [r.request_id for r in list(s.waiting)[:newly]]
            assert victims == running_before[len(running_before) - newly:]
            assert not any(rid in victims for rid, _, _ in batch_ids)
        assert len(s.running) <= s.pool.num_blocks
    assert sorted((r.request_id for r in done), key=int) == [str(i) for i in range(16)]
    assert all(len(r.output_token_ids) == 40 and r.finish_reason == "length" for r in done)
    assert s.num_preemptions > 0
    assert s.pool.usage() == start
