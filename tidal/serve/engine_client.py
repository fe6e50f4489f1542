"""The engine in its own process, and an asyncio face for the HTTP handlers.

:class:`EngineClient` starts the engine-core process (:mod:`tidal.serve.core_process`) and talks
to it over ZeroMQ (frames of :mod:`tidal.serve.wire`): requests and aborts go out, each step's
deltas come back in one frame and are put on the requests' queues. Handlers only await queues, so
a slow client never stalls a step (its deltas wait in its queue), and the HTTP process never
shares a GIL or a core with the model. A core that exits (killed, crashed) is seen within
``WATCH_INTERVAL``: every open request ends with :class:`EngineError` and ``/health`` says 503.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from tidal.engine.metrics import EngineMetrics
from tidal.engine.request import ImageItem, Logprob
from tidal.sampling_params import SamplingParams
from tidal.serve import wire
from tidal.serve.core_process import CoreSpec, run_engine_core

logger = logging.getLogger("tidal.serve")
# Seconds between checks that the engine-core process is alive.
WATCH_INTERVAL = 0.5


class EngineError(RuntimeError):
    """The engine failed, or the server is shutting down: in-flight requests end with this."""

    status = 503


class RequestFailedError(EngineError):
    """The engine step running this request raised (the request was aborted; the engine serves on)."""

    status = 500


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    fork_of: str | None = None  # another sample of the same prompt (EngineCore.add_request)
    images: list[ImageItem] | None = None  # each image at its placeholder offset


def sample_requests(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, images: list[ImageItem] | None = None) -> list[EngineRequest]:
    """The engine requests of one prompt: itself, or its ``params.n`` samples (ids ``{i}_{id}``,
    seeds ``seed + i``), the later ones forking from the first's prefill."""
    if params.n == 1:
        return [EngineRequest(request_id, prompt_token_ids, params, prompt, images=images)]
    ids = [f"{i}_{request_id}" for i in range(params.n)]
    return [EngineRequest(sid, prompt_token_ids, params.for_sample(i), prompt, fork_of=ids[0] if i else None,
                          images=images) for i, sid in enumerate(ids)]


@dataclass
class TokenDelta:
    """What one step added to one request: its new tokens (one per step without speculation),
    the text they completed (see :class:`_Track`), and, on the last delta, why it finished."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters after its last step, plus ``held_usage``: the fraction of the pool
    that requests hold, evictable prefix-cache memory counted as free (vLLM's kv_cache_usage_perc
    meaning; ``metrics.pool_usage`` counts the cache as used)."""

    metrics: EngineMetrics
    held_usage: float


class RequestStream:
    """Async iterator over the deltas of one or more engine requests (several for a multi-prompt
    completion), ending when all have finished. ``close()`` aborts whatever is unfinished; call it
    in a ``finally`` so a client that goes away frees its memory at once."""

    def __init__(self, client: EngineClient, sink: asyncio.Queue, request_ids: list[str]) -> None:
        self._client = client
        self._sink = sink
        self.request_ids = list(request_ids)
        self.pending = set(request_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if not self.pending:
            raise StopAsyncIteration
        item = await self._sink.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.pending.discard(item.request_id)
        return item

    def close(self) -> None:
        for rid in self.pending:
            self._client.abort(rid)
        self.pending.clear()



def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine client task %s failed", task.get_coro(), exc_info=task.exception())


class EngineStartError(RuntimeError):
    """The engine-core process could not start (its reason, or how it exited)."""


class EngineClient:
    """The engine-core process and the sockets to it. ``on_finished`` is called on the event loop
    with a :class:`~tidal.serve.wire.FinishedRequest` for every request that ends, for metrics.

    :meth:`start_core` (before the event loop runs) spawns the core and returns once its model and
    worker are up; :meth:`start` (on the loop) begins reading its frames."""

    def __init__(self, llm_kwargs: dict[str, Any], on_finished: Callable[[wire.FinishedRequest], None] | None = None,
                 *, log_level: str = "warning") -> None:
        self.llm_kwargs, self.on_finished, self.log_level = llm_kwargs, on_finished, log_level
        self._dir = tempfile.mkdtemp(prefix="tidal-core-")
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(f"ipc://{self._dir}/in")
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._dir}/out")
        self._apull: zmq.asyncio.Socket | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self.info: wire.EngineInfo | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._sinks: dict[str, asyncio.Queue] = {}
        self._adds: dict[str, asyncio.Future] = {}  # request id -> its acceptance by the core
        self._flushes: dict[int, asyncio.Future] = {}
        self._calls = itertools.count()
        self._stats = EngineStats(EngineMetrics(), 0.0)
        self._closing: str | None = None
        self.dead: str | None = None  # why the engine can no longer serve

    # ---- lifecycle ----------------------------------------------------------------------------
    def start_core(self, timeout: float | None = None) -> wire.EngineInfo:
        """Spawn the engine-core process and wait until it is ready (its model loaded, its worker's
        pool allocated). Raises EngineStartError with the core's reason when it cannot start."""
        self.spawn_core()
        return self.wait_ready(timeout)

    def spawn_core(self) -> None:
        spec = CoreSpec(self.llm_kwargs, f"ipc://{self._dir}/in", f"ipc://{self._dir}/out", os.getpid(),
                        self.log_level)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(spec,), name="tidal-engine-core", daemon=True)
        self.process.start()

    def wait_ready(self, timeout: float | None = None) -> wire.EngineInfo:
        assert self.process is not None, "spawn_core first"
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._pull.poll(200):
                msg = wire.unpack(self._pull.recv())
                if msg[0] == wire.READY:
                    self.info = wire.EngineInfo.from_wire(msg[1])
                    return self.info
                if msg[0] == wire.START_FAILED:
                    self.process.join(10)
                    raise EngineStartError(msg[1])
            elif not self.process.is_alive():
                raise EngineStartError(f"the engine core process exited with code {self.process.exitcode} "
                                       "while starting (see its log above)")
            if deadline is not None and time.monotonic() > deadline:
                self.kill_core()
                raise EngineStartError(f"the engine core was not ready within {timeout:g} s")

    def start(self) -> None:
        """Begin reading the core's frames and watching the process (on the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._apull = zmq.asyncio.Socket.from_socket(self._pull)
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]
        for t in self._tasks:
            t.add_done_callback(_log_failure)

    @property
    def alive(self) -> bool:
        self._check_process()
        return self.info is not None and self.process is not None and self.dead is None

    def fail_all(self, reason: str) -> None:
        """End every in-flight request with EngineError(reason) and refuse new ones (shutdown)."""
        self._closing = reason
        self._fail_everything(reason)

    def fail_all_threadsafe(self, reason: str) -> None:
        """``fail_all`` from any thread or a signal handler."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.fail_all, reason)

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the core (it aborts what runs and exits), then close the sockets."""
        self.fail_all(self._closing or "the server is shutting down")
        if self.alive:
            self._send(wire.pack(wire.STOP))
        if self.process is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, timeout)
            if self.process.is_alive():
                logger.warning("the engine core did not stop within %.0f s: killing it", timeout)
        self.kill_core()
        for t in self._tasks:
            t.cancel()
        self.close()

    def kill_core(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(10)

    def close(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- requests -----------------------------------------------------------------------------
    async def generate(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue ``requests`` in the engine. Raises what ``EngineCore.add_request`` raises
        (ValueError, RequestTooLongError, QueueFullError) with none of them left running, or
        EngineError."""
        if self._closing is not None:
            raise EngineError(self._closing)
        if not self.alive:
            raise EngineError(f"the engine is not running: {self.dead or 'stopped'}")
        sink: asyncio.Queue = asyncio.Queue()
        acks = []
        loop = asyncio.get_running_loop()
        for r in requests:
            self._sinks[r.request_id] = sink
            self._adds[r.request_id] = fut = loop.create_future()
            acks.append(fut)
            self._send(wire.pack_request(r))
        results = await asyncio.gather(*acks, return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        stream = RequestStream(self, sink, [r.request_id for r in requests])
        if errors:
            for r, res in zip(requests, results):
                if isinstance(res, BaseException):
                    stream.pending.discard(r.request_id)
                    self._sinks.pop(r.request_id, None)
            stream.close()
            raise errors[0]
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it already finished); the core frees its pages."""
        self._sinks.pop(request_id, None)
        self._send(wire.pack(wire.ABORT, request_id))

    async def flush_prefix_cache(self, timeout: float) -> bool:
        """Drop the prefix cache once no request is unfinished; False when prefix caching is off.
        TimeoutError if requests still run after ``timeout`` seconds (the flush is then dropped)."""
        if not self.alive:
            raise EngineError(f"the engine is not running: {self.dead or 'stopped'}")
        call = next(self._calls)
        self._flushes[call] = fut = asyncio.get_running_loop().create_future()
        self._send(wire.pack(wire.FLUSH_CACHE, call))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"requests were still running after {timeout:g} s") from None
        finally:
            self._flushes.pop(call, None)

    def stats(self) -> EngineStats:
        """The engine counters as of the core's last stats frame."""
        return self._stats

    def _send(self, frame: bytes) -> None:
        try:
            self._push.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the core is gone (or its queue is full): the watch reports it
            logger.warning("could not send to the engine core: %s", e)

    # ---- frames from the core (event loop) ----------------------------------------------------
    async def _read(self) -> None:
        assert self._apull is not None
        while True:
            frame = await self._apull.recv()
            try:
                self._handle(wire.unpack(frame))
            except Exception:  # noqa: BLE001 - one bad frame must not stop the reader
                logger.exception("bad frame from the engine core")

    def _handle(self, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == wire.OUTPUTS:
            for w in msg[1]:
                self._dispatch(TokenDelta(w[0], w[1], w[2], wire.logprobs_from_wire(w[3]), *w[4:10],
                                          prompt_logprobs=wire.logprobs_from_wire(w[10])))
            for w in msg[2]:
                self._finished(wire.FinishedRequest.from_wire(w))
        elif kind == wire.ADDED:
            fut = self._adds.pop(msg[1], None)
            if fut is not None and not fut.done():
                if msg[2] is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(wire.error_from_wire(msg[2], EngineError))
        elif kind == wire.STATS:
            self._stats = EngineStats(wire.metrics_from_wire(msg[1]), msg[2])
        elif kind == wire.FAILED:
            self._fail_requests(msg[1], msg[2], RequestFailedError)
        elif kind == wire.DEAD:
            self.dead = msg[1]
            self._fail_requests(msg[2], msg[1])
        elif kind == wire.FLUSHED:
            fut = self._flushes.get(msg[1])
            if fut is not None and not fut.done():
                if msg[3] is None:
                    fut.set_result(msg[2])
                else:
                    fut.set_exception(wire.error_from_wire(msg[3], EngineError))
        else:
            logger.error("unknown frame %r from the engine core", kind)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            self._check_process()

    def _check_process(self) -> None:
        """Notice a core that exited: mark the engine dead, fail everything open."""
        if self.process is None or self.dead is not None or self.process.is_alive():
            return
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self.dead = f"the engine core process (pid {self.process.pid}) exited ({how})"
        if self._closing is None:
            logger.error("%s", self.dead)
        self._fail_everything(self.dead)

    def _fail_everything(self, reason: str) -> None:
        alive = self.process is not None and self.process.is_alive()
        for rid, sink in list(self._sinks.items()):
            sink.put_nowait(EngineError(reason))
            if alive:
                self._send(wire.pack(wire.ABORT, rid))
        self._sinks.clear()
        for fut in [*self._adds.values(), *self._flushes.values()]:
            if not fut.done():
                fut.set_exception(EngineError(reason))
        self._adds.clear()

    def _finished(self, record: wire.FinishedRequest) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(record)
            except Exception:
                logger.exception("on_finished callback failed")

    def _dispatch(self, d: TokenDelta) -> None:
        sink = self._sinks.get(d.request_id)
        if sink is None:
            return
        sink.put_nowait(d)
        if d.finished:
            del self._sinks[d.request_id]

    def _fail_requests(self, rids: list[str], reason: str, error: type[EngineError] = EngineError) -> None:
        for rid in rids:
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink.put_nowait(error(reason))
