"""Load generation: an open loop (arrivals on a schedule, optionally capped in flight) and a
closed loop of N session lanes for a fixed time.

At a deadline, requests still in flight are cancelled and counted as ``cut``: they are neither
completed nor failed, and requests not yet sent are not counted at all. The client-side wait for
a concurrency slot is not part of any latency (the request's clock starts when it is sent)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tidal.bench.datasets import BenchRequest
from tidal.bench.records import RequestRecord

Send = Callable[[BenchRequest], Awaitable[RequestRecord]]
OnDone = Callable[[RequestRecord], None]


@dataclass
class RowRun:
    records: list[RequestRecord]
    start: float        # time.perf_counter() when dispatch began
    duration: float     # until the last request ended, or the deadline
    cut: int = 0


class SessionLike(Protocol):
    done: bool

    def next_request(self) -> BenchRequest: ...

    def add_reply(self, rec: RequestRecord) -> None: ...


def arrival_times(n: int, rate: float | None, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send offsets (s) of n requests: all at once for an infinite rate, else gamma-distributed
    gaps with mean 1/rate and shape ``burstiness`` (1 = Poisson; < 1 burstier). The first
    request goes at 0."""
    if rate is None or math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)


class _Recorder:
    """Sends requests, keeps their records and counts those in flight: a request cancelled at a
    deadline never decrements the count, so what is left is the number cut."""

    def __init__(self, send: Send, on_done: OnDone | None) -> None:
        self._send, self._on_done = send, on_done
        self.records: list[RequestRecord] = []
        self.inflight = 0

    async def __call__(self, req: BenchRequest) -> RequestRecord:
        self.inflight += 1
        rec = await self._send(req)
        self.inflight -= 1
        self.records.append(rec)
        if self._on_done:
            self._on_done(rec)
        return rec


async def _finish(tasks: list[asyncio.Task], timeout: float | None) -> None:
    """Wait for tasks (at most ``timeout``), cancel the rest, re-raise a task's own exception."""
    if tasks:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
    for t in tasks:
        if not t.done():
            t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, Exception):
            raise r


async def run_open_loop(requests: Sequence[BenchRequest], arrivals: Sequence[float], send: Send, *,
                        max_concurrency: int | None = None, max_duration: float | None = None,
                        on_done: OnDone | None = None) -> RowRun:
    """Send each request at its arrival offset; at most ``max_concurrency`` in flight."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    recorder = _Recorder(send, on_done)
    start = time.perf_counter()
    deadline = start + max_duration if max_duration else math.inf

    async def one(req: BenchRequest) -> None:
        async with sem if sem is not None else contextlib.nullcontext():
            if time.perf_counter() < deadline:
                await recorder(req)

    tasks: list[asyncio.Task] = []
    for req, at in zip(requests, arrivals):
        wait = min(start + at, deadline) - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(one(req)))
    await _finish(tasks, None if math.isinf(deadline) else max(deadline - time.perf_counter(), 0.0))
    end = min(time.perf_counter(), deadline)
    return RowRun(recorder.records, start, end - start, recorder.inflight)


async def run_closed_loop(new_session: Callable[[], SessionLike], send: Send, *, lanes: int, max_duration: float,
                          on_done: OnDone | None = None) -> RowRun:
    """``lanes`` concurrent sessions, each sending its next turn as soon as the last reply
    arrives; a lane starts a new session when its session ends or a turn fails. Runs exactly
    ``max_duration`` seconds."""
    recorder = _Recorder(send, on_done)

    async def lane() -> None:
        session: SessionLike | None = None
        while True:
            if session is None or session.done:
                session = new_session()
            rec = await recorder(session.next_request())
            if rec.ok:
                session.add_reply(rec)
            else:
                session = None

    start = time.perf_counter()
    tasks = [asyncio.create_task(lane()) for _ in range(lanes)]
    await _finish(tasks, max_duration)
    return RowRun(recorder.records, start, min(time.perf_counter() - start, max_duration), recorder.inflight)
