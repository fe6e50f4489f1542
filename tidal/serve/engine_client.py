"""The engine on its own thread, and an asyncio face for the HTTP handlers.

The thread owns the :class:`EngineCore` outright: it takes add/abort commands from a queue,
steps while anything is unfinished, and posts each step's per-request deltas to the event loop.
Handlers only await queues, so a slow client never stalls a step (its deltas wait in its queue),
and a step never blocks the HTTP loop (torch releases the GIL while it computes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.engine.core import EngineCore
from tidal.engine.faults import StepFailedError
from tidal.engine.metrics import EngineMetrics
from tidal.engine.request import ImageItem, Logprob, RequestOutput
from tidal.sampling_params import SamplingParams

logger = logging.getLogger("tidal.serve")


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


class _Track:
    """Engine-thread bookkeeping of one request: how much of its output has been posted. The text is
    the engine's (detokenised once there, stop strings already cut); while the request runs the
    last ``len(longest stop) - 1`` characters are held back, since a stop string still arriving
    may cut them."""

    def __init__(self, params: SamplingParams) -> None:
        stops = params.stop_strings
        self.holdback = max(map(len, stops)) - 1 if stops else 0
        self.num_tokens = 0
        self.num_text = 0
        self.sent_prompt_logprobs = False

    def text_delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else max(self.num_text, len(text) - self.holdback)
        delta, self.num_text = text[self.num_text:end], end
        return delta


_STOP = object()
# Seconds between refreshes of the engine stats while requests run (each costs a pool scan).
STATS_INTERVAL = 0.05


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


class EngineClient:
    """Runs ``engine`` on a daemon thread. ``on_finished`` is called on that thread with the final
    output of every request that ends (finished or aborted), for metrics."""

    def __init__(self, engine: EngineCore, on_finished: Callable[[RequestOutput], None] | None = None) -> None:
        self.engine = engine
        self.on_finished = on_finished
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[str, asyncio.Queue] = {}  # touched on the loop thread only
        self._tracks: dict[str, _Track] = {}  # touched on the engine thread only
        self._idle_calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []  # engine thread
        self._stats = self._take_stats()
        self._stats_time = 0.0
        self._closing: str | None = None
        self.dead: str | None = None  # why the engine can no longer serve

    # ---- lifecycle (loop thread) ----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def fail_all(self, reason: str) -> None:
        """End every in-flight request with EngineError(reason) and refuse new ones (shutdown)."""
        self._closing = reason
        for rid, sink in list(self._sinks.items()):
            sink.put_nowait(EngineError(reason))
            self._commands.put(("abort", rid))
        self._sinks.clear()

    def fail_all_threadsafe(self, reason: str) -> None:
        """``fail_all`` from any thread or a signal handler."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.fail_all, reason)

    async def stop(self, timeout: float = 10.0) -> None:
        self.fail_all(self._closing or "the server is shutting down")
        self._commands.put(_STOP)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s", timeout)

    # ---- requests (loop thread) -----------------------------------------------------------------
    async def generate(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue ``requests`` in the engine. Raises what ``EngineCore.add_request`` raises
        (ValueError, RequestTooLongError) with none of them left running, or EngineError."""
        if self._closing is not None:
            raise EngineError(self._closing)
        if not self.alive:
            raise EngineError(f"the engine is not running: {self.dead or 'stopped'}")
        sink: asyncio.Queue = asyncio.Queue()
        futures = []
        for r in requests:
            self._sinks[r.request_id] = sink
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(("add", r, fut))
            futures.append(fut)
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
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
        """Abort a request (no-op when it already finished); its pages are freed on the engine thread."""
        self._sinks.pop(request_id, None)
        self._commands.put(("abort", request_id))

    async def call_when_idle(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn`` on the engine thread once no request is unfinished (e.g. flushing the prefix
        cache); TimeoutError if that takes longer than ``timeout`` seconds (``fn`` then never runs)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("idle_call", fn, fut))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"requests were still running after {timeout:g} s") from None

    def stats(self) -> EngineStats:
        """The engine counters as of the last step (a copy; safe to read on any thread)."""
        return self._stats

    def _take_stats(self) -> EngineStats:
        """On the engine thread (or before it starts)."""
        pool = self.engine.pool
        held = 1.0 - pool.available_pages / max(1, pool.total_pages)
        return EngineStats(dataclasses.replace(self.engine.metrics()), held)

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as e:
                logger.exception("the engine thread failed")
                self.dead = f"{type(e).__name__}: {e}"
                self._fail_tracked(f"the engine failed: {self.dead}")

    def _iterate(self) -> bool:
        """Take commands (waiting for one when there is nothing to step), then step once. False
        when told to stop."""
        engine = self.engine
        busy = self.dead is None and engine.has_unfinished_requests()
        for cmd in self._take_commands(block=not busy):
            if cmd is _STOP:
                self._abort_everything()
                return False
            self._handle(cmd)
        if self._idle_calls and not engine.has_unfinished_requests():
            self._run_idle_calls()
        if self.dead is None and engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except StepFailedError as e:  # the engine aborted the step's requests and logged why
                outputs = []
                failed = [rid for rid in e.request_ids if self._tracks.pop(rid, None) is not None]
                self._post(self._fail_requests, failed, str(e), RequestFailedError)
                if e.dead is not None:
                    self.dead = e.dead
                    self._fail_tracked(f"the engine is dead: {e.dead}")
            except Exception as e:
                logger.exception("engine step failed")
                self._fail_tracked(f"the engine failed: {type(e).__name__}: {e}")
                outputs = []
            deltas = [self._delta(o) for o in outputs]
            if deltas:
                self._post(self._dispatch, deltas)
        now = time.monotonic()
        if now - self._stats_time > STATS_INTERVAL or not engine.has_unfinished_requests():
            self._stats, self._stats_time = self._take_stats(), now
        return True

    def _take_commands(self, block: bool) -> list:
        out = [self._commands.get()] if block else []
        while True:
            try:
                out.append(self._commands.get_nowait())
            except queue.Empty:
                return out

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, r, fut = cmd
            if not fut.set_running_or_notify_cancel():
                return
            try:
                if self.dead is not None:
                    raise EngineError(f"the engine is not running: {self.dead}")
                self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, prompt=r.prompt,
                                        arrival_time=r.arrival_time, fork_of=r.fork_of, images=r.images)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting handler
                fut.set_exception(e)
                return
            self._tracks[r.request_id] = _Track(r.params)
            fut.set_result(None)
        elif cmd[0] == "idle_call":
            self._idle_calls.append(cmd[1:])
        elif cmd[0] == "abort":
            rid = cmd[1]
            if self._tracks.pop(rid, None) is None:
                return
            out = self.engine.abort_request(rid)
            if out is not None:
                self._finished(out)

    def _run_idle_calls(self) -> None:
        calls, self._idle_calls = self._idle_calls, []
        for fn, fut in calls:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting handler
                fut.set_exception(e)

    def _delta(self, out: RequestOutput) -> TokenDelta:
        tr = self._tracks[out.request_id]
        comp = out.outputs[0]
        new_ids = comp.token_ids[tr.num_tokens:]
        delta = TokenDelta(
            request_id=out.request_id,
            token_ids=new_ids,
            text=tr.text_delta(comp.text, out.finished),
            logprobs=comp.logprobs[tr.num_tokens:] if comp.logprobs is not None else None,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=len(comp.token_ids),
            finished=out.finished,
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
            num_cached_tokens=out.num_cached_tokens,
        )
        if not tr.sent_prompt_logprobs:
            delta.prompt_logprobs = out.prompt_logprobs
            tr.sent_prompt_logprobs = True
        tr.num_tokens = len(comp.token_ids)
        if out.finished:
            del self._tracks[out.request_id]
            self._finished(out)
        return delta

    def _finished(self, out: RequestOutput) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(out)
            except Exception:
                logger.exception("on_finished callback failed")

    def _fail_tracked(self, reason: str) -> None:
        """After a failed step: abort everything in flight and tell its handlers why."""
        rids = list(self._tracks)
        self._tracks.clear()
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception as e:  # noqa: BLE001
                self.dead = f"{reason}; abort failed: {e}"
        self._post(self._fail_requests, rids, reason)

    def _abort_everything(self) -> None:
        for rid in list(self._tracks):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed at shutdown", rid)
        self._tracks.clear()

    def _post(self, fn: Callable, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed in between
                pass

    # ---- loop-thread callbacks ------------------------------------------------------------------
    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            sink = self._sinks.get(d.request_id)
            if sink is None:
                continue
            sink.put_nowait(d)
            if d.finished:
                del self._sinks[d.request_id]

    def _fail_requests(self, rids: list[str], reason: str, error: type[EngineError] = EngineError) -> None:
        for rid in rids:
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink.put_nowait(error(reason))
