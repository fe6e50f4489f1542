"""The messages between the HTTP process and the engine-core process (ZeroMQ frames, msgpack).

Every frame is a msgpack list ``[kind, *fields]``. The per-step traffic is plain msgpack: token
deltas (with their text, detokenized in the core), finished-request records and stats. A new
request is the one exception: its :class:`EngineRequest` (sampling parameters, a grammar spec,
image pixels) travels pickled inside the frame, once per request, between two processes of the
same server over a private ipc socket.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any

import msgpack

from tidal.engine.metrics import EngineMetrics, RequestMetrics
from tidal.engine.request import Logprob, QueueFullError, RequestOutput, RequestTooLongError
from tidal.plan import PoolLayout

# HTTP -> core
ADD, ABORT, FLUSH_CACHE, STOP = "add", "abort", "flush_cache", "stop"
# core -> HTTP
READY, START_FAILED, ADDED, OUTPUTS, FAILED, DEAD, STATS, FLUSHED = (
    "ready", "start_failed", "added", "outputs", "failed", "dead", "stats", "flushed")


def pack(kind: str, *fields: Any) -> bytes:
    return msgpack.packb([kind, *fields], use_bin_type=True)


def unpack(frame: bytes) -> list[Any]:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def pack_request(request: Any) -> bytes:
    return pack(ADD, pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))


def unpack_request(blob: bytes) -> Any:
    return pickle.loads(blob)


# ---- what the HTTP process needs to know about the engine -------------------------------------
@dataclass(frozen=True)
class EngineInfo:
    """The engine core's facts the HTTP process serves with (sent once, in the ready frame)."""

    max_request_len: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    max_num_batched_tokens: int
    layout: PoolLayout
    dtype: str
    device: str
    pid: int

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> EngineInfo:
        return cls(**{**d, "eos_token_ids": tuple(d["eos_token_ids"]), "layout": PoolLayout(**d["layout"])})


# ---- logprobs -----------------------------------------------------------------------------------
def logprobs_to_wire(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    if entries is None:
        return None
    return [None if e is None else {t: [lp.logprob, lp.rank, lp.decoded_token] for t, lp in e.items()}
            for e in entries]


def logprobs_from_wire(entries: list | None) -> list[dict[int, Logprob] | None] | None:
    if entries is None:
        return None
    return [None if e is None else {t: Logprob(*v) for t, v in e.items()} for e in entries]


# ---- finished requests (for the server's histograms) ---------------------------------------------
@dataclass
class FinishedRequest:
    """What the server's metrics observe of a request that ended (finished or aborted)."""

    request_id: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics | None

    @classmethod
    def of(cls, out: RequestOutput) -> FinishedRequest:
        comp = out.outputs[0]
        return cls(out.request_id, comp.finish_reason, len(out.prompt_token_ids), len(comp.token_ids), out.metrics)

    def to_wire(self) -> list[Any]:
        m = dataclasses.asdict(self.metrics) if self.metrics is not None else None
        return [self.request_id, self.finish_reason, self.num_prompt_tokens, self.num_output_tokens, m]

    @classmethod
    def from_wire(cls, w: list[Any]) -> FinishedRequest:
        rid, reason, p, n, m = w
        return cls(rid, reason, p, n, RequestMetrics(**m) if m is not None else None)


def metrics_from_wire(d: dict[str, Any]) -> EngineMetrics:
    return EngineMetrics(**d)


# ---- errors -------------------------------------------------------------------------------------
_ERRORS: dict[str, type[Exception]] = {
    "RequestTooLongError": RequestTooLongError, "QueueFullError": QueueFullError, "ValueError": ValueError,
}


def error_to_wire(e: BaseException) -> list[str]:
    name = type(e).__name__
    if name not in _ERRORS:
        name = "ValueError" if isinstance(e, ValueError) else "EngineError"
    return [name, str(e)]


def error_from_wire(w: list[str], engine_error: type[Exception]) -> Exception:
    """The exception the core raised, as the HTTP handlers know it (engine errors as ``engine_error``)."""
    name, message = w
    return _ERRORS.get(name, engine_error)(message)
