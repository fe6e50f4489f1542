"""The engine-core process: the scheduler, the allocator and the (in-process) worker, stepping.

The HTTP process starts it (:class:`tidal.serve.engine_client.EngineClient`) and talks to it over
two ZeroMQ sockets (frames of :mod:`tidal.serve.wire`): requests and aborts come in, each step's
token deltas (text already detokenized here, stop strings cut), finished-request records and
stats go out, one frame per step. The HTTP process does no per-token work beyond SSE framing.

Lifecycle: the frame ``ready`` goes out only once the model is loaded and the worker has its
pool; a failed start sends ``start_failed`` with the reason. The process ends when told to stop,
when its parent dies (``PR_SET_PDEATHSIG``, and a watch of the parent pid for the case the signal
cannot cover) and on SIGTERM. A step that fails aborts its requests (``failed``); an engine that can
no longer step says why (``dead``) and keeps answering, failing every request it is given.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from tidal.serve import wire

logger = logging.getLogger("tidal.engine")

# Seconds between stats frames while requests run (each costs a pool scan).
STATS_INTERVAL = 0.05
PARENT_WATCH_INTERVAL = 0.5
PR_SET_PDEATHSIG = 1


@dataclass
class CoreSpec:
    """How the child builds its engine: ``LLM(**llm_kwargs)``, and where it connects."""

    llm_kwargs: dict[str, Any]
    input_address: str  # the HTTP process pushes here
    output_address: str  # and pulls from here
    parent_pid: int
    log_level: str = "warning"
    env: dict[str, str] = field(default_factory=dict)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent goes (Linux), and watch the parent pid as a backstop."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(PARENT_WATCH_INTERVAL)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="tidal-parent-watch", daemon=True).start()


class _Track:
    """Bookkeeping of one request: how much of its output has gone out. The text is the engine's
    (detokenised once, stop strings already cut); while the request runs the last
    ``len(longest stop) - 1`` characters are held back, since a stop string still arriving may
    cut them."""

    def __init__(self, params: Any) -> None:
        stops = params.stop_strings
        self.holdback = max(map(len, stops)) - 1 if stops else 0
        self.num_tokens = 0
        self.num_text = 0
        self.sent_prompt_logprobs = False

    def text_delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else max(self.num_text, len(text) - self.holdback)
        delta, self.num_text = text[self.num_text:end], end
        return delta


class CoreLoop:
    """Takes frames from ``inbox``, steps the engine while anything is unfinished, and sends each
    step's deltas to ``outbox``."""

    def __init__(self, engine: Any, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self.inbox, self.outbox = inbox, outbox
        self.tracks: dict[str, _Track] = {}
        self.flush_calls: list[int] = []  # flush_cache calls waiting for the engine to be idle
        self.dead: str | None = None
        self.stats_time = 0.0
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            try:
                self.iterate()
            except zmq.ZMQError:
                raise
            except Exception as e:  # noqa: BLE001 - a bug outside the step guard
                logger.exception("the engine core failed")
                self.fail_dead(f"the engine failed: {type(e).__name__}: {e}")

    def iterate(self) -> None:
        engine = self.engine
        busy = self.dead is None and engine.has_unfinished_requests()
        for frame in self.take_frames(block=not busy):
            self.handle(wire.unpack(frame))
            if self.stopping:
                return
        if self.flush_calls and not engine.has_unfinished_requests():
            self.run_flushes()
        outputs, finished, failed = [], [], None
        if self.dead is None and engine.has_unfinished_requests():
            from tidal.engine.faults import StepFailedError

            try:
                outputs = engine.step()
            except StepFailedError as e:  # the engine aborted the step's requests and logged why
                rids = [rid for rid in e.request_ids if self.tracks.pop(rid, None) is not None]
                failed = [rids, str(e)]
                if e.dead is not None:
                    self.send(wire.FAILED, *failed)
                    failed = None
                    self.fail_dead(f"the engine is dead: {e.dead}")
        deltas = [self.delta(o, finished) for o in outputs]
        if deltas or finished:
            self.send(wire.OUTPUTS, deltas, [f.to_wire() for f in finished])
        if failed is not None:
            self.send(wire.FAILED, *failed)
        now = time.monotonic()
        if now - self.stats_time > STATS_INTERVAL or not engine.has_unfinished_requests():
            self.send_stats()
            self.stats_time = now

    def take_frames(self, block: bool) -> list[bytes]:
        frames = []
        if block:
            while not self.inbox.poll(1000):
                self.check_workers()
        while True:
            try:
                frames.append(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return frames

    def check_workers(self) -> None:
        """An idle core notices a rank's worker lost (a busy one fails its step)."""
        alive = getattr(self.engine.worker, "alive", None)
        if self.dead is None and alive is not None and not alive():
            self.fail_dead(f"the engine is dead: a worker is lost: {self.engine.worker.lost}")

    def handle(self, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == wire.ADD:
            r = wire.unpack_request(msg[1])
            try:
                if self.dead is not None:
                    raise RuntimeError(f"the engine is not running: {self.dead}")
                self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, prompt=r.prompt,
                                        arrival_time=r.arrival_time, fork_of=r.fork_of, images=r.images)
            except Exception as e:  # noqa: BLE001 - the HTTP handler raises it
                self.send(wire.ADDED, r.request_id, wire.error_to_wire(e))
                return
            self.tracks[r.request_id] = _Track(r.params)
            self.send(wire.ADDED, r.request_id, None)
        elif kind == wire.ABORT:
            rid = msg[1]
            if self.tracks.pop(rid, None) is None:
                return
            out = self.engine.abort_request(rid)
            if out is not None:
                self.send(wire.OUTPUTS, [], [wire.FinishedRequest.of(out).to_wire()])
        elif kind == wire.FLUSH_CACHE:
            self.flush_calls.append(msg[1])
        elif kind == wire.STOP:
            for rid in list(self.tracks):
                self.engine.abort_request(rid)
            self.tracks.clear()
            self.stopping = True
        else:
            logger.error("unknown frame %r", kind)

    def run_flushes(self) -> None:
        calls, self.flush_calls = self.flush_calls, []
        for call in calls:
            try:
                self.send(wire.FLUSHED, call, self.engine.flush_prefix_cache(), None)
            except Exception as e:  # noqa: BLE001
                self.send(wire.FLUSHED, call, False, wire.error_to_wire(e))

    def delta(self, out: Any, finished: list[wire.FinishedRequest]) -> list[Any]:
        """The wire form of a TokenDelta: what ``out`` added since the last one."""
        tr = self.tracks[out.request_id]
        comp = out.outputs[0]
        new_ids = comp.token_ids[tr.num_tokens:]
        logprobs = comp.logprobs[tr.num_tokens:] if comp.logprobs is not None else None
        prompt_logprobs = None
        if not tr.sent_prompt_logprobs:
            prompt_logprobs = out.prompt_logprobs
            tr.sent_prompt_logprobs = True
        tr.num_tokens = len(comp.token_ids)
        if out.finished:
            del self.tracks[out.request_id]
            finished.append(wire.FinishedRequest.of(out))
        return [out.request_id, new_ids, tr.text_delta(comp.text, out.finished), wire.logprobs_to_wire(logprobs),
                len(out.prompt_token_ids), len(comp.token_ids), out.finished, comp.finish_reason, comp.stop_reason,
                out.num_cached_tokens, wire.logprobs_to_wire(prompt_logprobs)]

    def fail_dead(self, reason: str) -> None:
        """Abort everything in flight and refuse what comes: the engine can no longer step."""
        self.dead = reason
        rids = list(self.tracks)
        self.tracks.clear()
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", rid)
        self.send(wire.DEAD, reason, rids)

    def send_stats(self) -> None:
        import dataclasses

        pool = self.engine.pool
        held = 1.0 - pool.available_pages / max(1, pool.total_pages)
        self.send(wire.STATS, dataclasses.asdict(self.engine.metrics()), held)

    def send(self, kind: str, *fields: Any) -> None:
        self.outbox.send(wire.pack(kind, *fields))


def engine_info(engine: Any) -> wire.EngineInfo:
    return wire.EngineInfo(
        max_request_len=engine.max_request_len, max_model_len=engine.max_model_len,
        eos_token_ids=tuple(engine.eos_token_ids), max_num_batched_tokens=engine.config.max_num_batched_tokens,
        layout=engine.layout, dtype=str(engine.dtype).removeprefix("torch."), device=str(engine.device),
        pid=os.getpid(),
    )


def run_engine_core(spec: CoreSpec) -> None:
    """The child's entry point (multiprocessing spawn target)."""
    die_with_parent(spec.parent_pid)
    os.environ.update(spec.env)
    logging.basicConfig(level=spec.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(spec.input_address)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(spec.output_address)
    try:
        from tidal.llm import LLM

        llm = LLM(**spec.llm_kwargs)
        engine = llm.engine
    except Exception as e:  # noqa: BLE001 - reported to the parent, which exits with it
        outbox.send(wire.pack(wire.START_FAILED, f"{e}"))
        outbox.close()
        ctx.term()
        sys.exit(1)
    outbox.send(wire.pack(wire.READY, engine_info(engine).to_wire()))
    loop = CoreLoop(engine, inbox, outbox)
    loop.send_stats()
    loop.run()
    llm.close()  # the rank workers stop (on every node)
    outbox.close()
    inbox.close(linger=0)
    ctx.term()
