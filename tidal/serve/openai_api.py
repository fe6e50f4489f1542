"""OpenAI responses: engine deltas -> parser events -> chat/completion chunks and bodies.

Responses are plain dicts, built per token on the streaming path where a model round-trip would
cost more than the JSON itself. Request models live in :mod:`tidal.serve.openai_protocol`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tidal.engine.request import Logprob
from tidal.serve.chat import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ReplyParser,
    ToolCallStart,
)
from tidal.serve.engine_client import EngineError, RequestStream, TokenDelta
from tidal.serve.errors import APIError, openai_envelope

logger = logging.getLogger("tidal.serve")


# ---- responses --------------------------------------------------------------------------------------

def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
          cached_tokens: int = 0) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return u


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return ranked[:k]


def _token_str(tid: int, lp: Logprob, as_ids: bool = False) -> str:
    """A token as logprobs name it: its text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``, and for a token with no text)."""
    return lp.decoded_token if lp.decoded_token is not None and not as_ids else f"token_id:{tid}"


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                  token_bytes: Callable[[int], bytes] | None = None, as_ids: bool = False) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat response for these tokens. ``bytes`` are the token's own
    bytes when the tokenizer knows them (a byte-level token's text alone may be U+FFFD)."""

    def item(tid: int, lp: Logprob) -> dict[str, Any]:
        tok = _token_str(tid, lp, as_ids)
        raw = token_bytes(tid) if token_bytes is not None else tok.encode("utf-8")
        return {"token": tok, "logprob": max(lp.logprob, -9999.0), "bytes": list(raw)}

    content = []
    for tid, entry in zip(token_ids, entries):
        content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, v) for t, v in _top(entry, k)]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int,
                        text_offset: int, piece: Callable[[int], str], as_ids: bool = False) -> dict[str, Any]:
    """``choices[].logprobs`` of a completion (the legacy parallel-list shape): ``top_logprobs``
    holds the k likeliest tokens and the sampled one (so ``logprobs=0`` gives one entry, as vLLM
    does). ``piece`` names a token that has no entry (the first prompt token, when echoing)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            tokens.append(piece(tid))
            token_lps.append(None)
            tops.append(None)
        else:
            lp = entry[tid]
            tokens.append(_token_str(tid, lp, as_ids))
            token_lps.append(max(lp.logprob, -9999.0))
            top: dict[str, float] = {}
            for t, v in _top(entry, k):  # tokens with the same text: the likelier one stays
                top.setdefault(_token_str(t, v, as_ids), max(v.logprob, -9999.0))
            top.setdefault(tokens[-1], token_lps[-1])
            tops.append(top)
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_body(entries: list[dict[int, Logprob] | None], k: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first has none) its own entry and the ``k``
    likeliest (-1: all) as ``{token_id: {logprob, rank, decoded_token}}``."""
    out: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        target, *rest = entry.items()
        keep = [target] + [(t, lp) for t, lp in rest if k == -1 or (lp.rank is not None and lp.rank <= k)]
        out.append({str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for t, lp in keep})
    return out


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any] | None, *,
               finish_reason: str | None = None, stop_reason: int | str | None = None,
               logprobs: dict[str, Any] | None = None, usage_: dict[str, Any] | None = None,
               index: int = 0) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` makes the usage-only chunk (``choices: []``)."""
    choices = [] if delta is None else [{
        "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }]
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def completion_chunk(rid: str, created: int, model: str, index: int | None, text: str, *,
                     finish_reason: str | None = None, stop_reason: int | str | None = None,
                     logprobs: dict[str, Any] | None = None, usage_: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """One ``text_completion`` chunk; ``index=None`` makes the usage-only chunk."""
    choices = [] if index is None else [{
        "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def sse_data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error(exc: BaseException) -> str:
    """The last event of a stream that failed after its 200 went out (vLLM's shape)."""
    if isinstance(exc, EngineError):
        err = APIError(503, str(exc))
    else:
        logger.exception("stream failed", exc_info=exc)
        err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
    return sse_data(openai_envelope(err))


# ---- chat: engine deltas -> parser events -> OpenAI deltas ---------------------------------------------

@dataclass
class ChatOptions:
    id: str
    model: str
    created: int
    num_logprobs: int | None = None
    include_usage: bool = False
    continuous_usage: bool = False
    include_reasoning: bool = True
    reasoning_alias: bool = False  # also write vLLM's ``reasoning`` next to ``reasoning_content``
    token_bytes: Callable[[int], bytes] | None = None
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: echoed, with each reply's ids
    num_prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (non-streaming only)


class ChatAccumulator:
    """Feeds one request's token deltas through the format's reply parser. Each ``step`` gives the
    OpenAI delta for that token (None while a marker is still unresolved or the token completed
    no text) with the logprobs of every token since the last delta; it also keeps the counts."""

    def __init__(self, parser: ReplyParser, opts: ChatOptions, index: int = 0) -> None:
        self.parser = parser
        self.opts = opts
        self.index = index  # the choice (sample) this accumulator builds
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._lp_ids: list[int] = []
        self._lp_entries: list[dict[int, Logprob]] = []
        self.all_logprobs: list[dict[str, Any]] = []
        self.token_ids: list[int] = []
        self._new_ids: list[int] = []  # token ids since the last delta went out
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def step(self, d: TokenDelta) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(delta, logprobs) for this engine delta."""
        self.prompt_tokens, self.completion_tokens = d.num_prompt_tokens, d.num_output_tokens
        self.cached_tokens = d.num_cached_tokens
        self.token_ids += d.token_ids
        self._new_ids += d.token_ids
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if self.parser.in_reasoning:
            self.reasoning_tokens += len(d.token_ids)
        events = self.parser.feed(d.text) if d.text else []
        if d.finished:
            events += self.parser.finish()
            called = bool(self.parser.result.tool_calls)
            self.finish_reason = "tool_calls" if d.finish_reason == "stop" and called else d.finish_reason
            self.stop_reason = d.stop_reason
        if self.opts.num_logprobs is not None and d.logprobs is not None:
            self._lp_ids += d.token_ids
            self._lp_entries += d.logprobs
        delta = self._delta(events)
        if delta is None and not d.finished:
            return None, None
        logprobs = None
        if self.opts.num_logprobs is not None:
            logprobs = chat_logprobs(self._lp_ids, self._lp_entries, self.opts.num_logprobs, self.opts.token_bytes,
                                     self.opts.tokens_as_ids)
            self.all_logprobs += logprobs["content"]
            self._lp_ids, self._lp_entries = [], []
        return delta or {}, logprobs

    def _delta(self, events: list[Event]) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        calls: dict[int, dict[str, Any]] = {}
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                if self.opts.include_reasoning:
                    delta["reasoning_content"] = delta.get("reasoning_content", "") + ev.text
            elif isinstance(ev, ContentDelta):
                delta["content"] = delta.get("content", "") + ev.text
            elif isinstance(ev, ToolCallStart):
                calls[ev.index] = {"index": ev.index, "id": ev.id, "type": "function",
                                   "function": {"name": ev.name, "arguments": ""}}
            else:
                call = calls.setdefault(ev.index, {"index": ev.index, "function": {"arguments": ""}})
                call["function"]["arguments"] += ev.arguments
        if calls:
            delta["tool_calls"] = list(calls.values())
        if self.opts.reasoning_alias and "reasoning_content" in delta:
            delta["reasoning"] = delta["reasoning_content"]
        return delta or None

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.reasoning_tokens, self.cached_tokens)

    def message(self) -> dict[str, Any]:
        """The whole reply as a non-streaming ``message``."""
        r = self.parser.result
        msg: dict[str, Any] = {"role": "assistant", "content": r.content if r.content or not r.tool_calls else None}
        if self.opts.include_reasoning:
            msg["reasoning_content"] = r.reasoning or None
            if self.opts.reasoning_alias:
                msg["reasoning"] = r.reasoning or None
        if r.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in r.tool_calls]
        # every field of OpenAI's ChatCompletionMessage is present, null when unused, as OpenAI and vLLM send them
        for name in ("tool_calls", "refusal", "annotations", "audio", "function_call"):
            msg.setdefault(name, None)
        return msg


async def framed(body: AsyncIterator[str], stream: RequestStream) -> AsyncIterator[str]:
    """An OpenAI SSE body: the chunks, an error event if they fail midway, then ``[DONE]``; the
    engine request is aborted however the stream ends early (client gone included)."""
    try:
        async for piece in body:
            yield piece
    except Exception as e:  # noqa: BLE001 - the status is sent: the error goes in the stream
        yield stream_error(e)
    finally:
        stream.close()
    yield SSE_DONE


def chat_usage(accs: list[ChatAccumulator]) -> dict[str, Any]:
    """Usage of all choices: the prompt once, the completions summed (OpenAI's n > 1)."""
    first = accs[0]
    return usage(first.prompt_tokens, sum(a.completion_tokens for a in accs),
                 sum(a.reasoning_tokens for a in accs), first.cached_tokens)


async def chat_stream(stream: RequestStream, accs: dict[str, ChatAccumulator]) -> AsyncIterator[str]:
    """SSE chunks of a chat completion (``accs``: engine request id -> its choice): a role delta
    per choice, then one chunk per token that completed text (the last one of a choice carrying
    its finish_reason), then the usage-only chunk when asked for."""
    choices = list(accs.values())
    o = choices[0].opts

    def chunk(acc: ChatAccumulator, delta: dict[str, Any], **kw: Any) -> str:
        c = chat_chunk(o.id, o.created, o.model, delta, index=acc.index, **kw)
        if o.continuous_usage:
            c["usage"] = chat_usage(choices)
        if o.prompt_token_ids is not None and c["choices"]:
            c["choices"][0]["token_ids"], acc._new_ids = acc._new_ids, []
        return sse_data(c)

    for acc in choices:
        first = chat_chunk(o.id, o.created, o.model, {"role": "assistant", "content": ""}, index=acc.index)
        if o.prompt_token_ids is not None:
            first["prompt_token_ids"] = o.prompt_token_ids
        if o.continuous_usage:  # every chunk carries usage, the role chunk too (vLLM's continuous_usage_stats)
            first["usage"] = chat_usage(choices)
        yield sse_data(first)
    async for d in stream:
        acc = accs[d.request_id]
        delta, logprobs = acc.step(d)
        if delta is None:
            continue
        if d.finished:
            yield chunk(acc, delta, logprobs=logprobs, finish_reason=acc.finish_reason, stop_reason=acc.stop_reason)
        else:
            yield chunk(acc, delta, logprobs=logprobs)
    if o.include_usage:
        yield sse_data(chat_chunk(o.id, o.created, o.model, None, usage_=chat_usage(choices)))


def chat_response(deltas: list[TokenDelta], accs: dict[str, ChatAccumulator]) -> dict[str, Any]:
    for d in deltas:
        accs[d.request_id].step(d)
    choices = sorted(accs.values(), key=lambda a: a.index)
    o = choices[0].opts
    body = {
        "id": o.id, "object": "chat.completion", "created": o.created, "model": o.model,
        "choices": [{
            "index": acc.index, "message": acc.message(),
            "logprobs": {"content": acc.all_logprobs} if o.num_logprobs is not None else None,
            "finish_reason": acc.finish_reason, "stop_reason": acc.stop_reason,
        } for acc in choices],
        "usage": chat_usage(choices),
        "system_fingerprint": None, "service_tier": None,
    }
    if o.prompt_token_ids is not None:
        body["prompt_token_ids"] = o.prompt_token_ids
        for c, acc in zip(body["choices"], choices):
            c["token_ids"] = acc.token_ids
    if o.num_prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(choices[0].prompt_logprobs or [], o.num_prompt_logprobs)
    return body


# ---- completions ---------------------------------------------------------------------------------------

@dataclass
class CompletionOptions:
    id: str
    model: str
    created: int
    index_of: dict[str, int]  # engine request id -> choice index
    echo_text: list[str | None]  # per choice: the prompt text to echo, or None
    prompt_ids: list[list[int]]  # per choice (echoed with their logprobs)
    num_logprobs: int | None = None
    include_usage: bool = False
    continuous_usage: bool = False
    n: int = 1  # samples per prompt: choice i is sample i % n of prompt i // n
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and token_ids on each choice
    num_prompt_logprobs: int | None = None  # vLLM's prompt_logprobs on each choice (non-streaming only)


class CompletionAccumulator:
    """Per-choice text, logprobs and counts of a (multi-prompt) completion."""

    def __init__(self, opts: CompletionOptions, piece: Callable[[int], str]) -> None:
        self.opts = opts
        self.piece = piece
        n = len(opts.echo_text)
        self.text = [""] * n
        self.started = [False] * n
        self.offset = [0] * n
        self.prompt_tokens = [0] * n
        self.completion_tokens = [0] * n
        self.cached_tokens = [0] * n
        self.finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n
        self.logprobs: list[dict[str, list] | None] = [None] * n
        self._lp_ids: list[list[int]] = [[] for _ in range(n)]
        self._lp_entries: list[list] = [[] for _ in range(n)]
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.new_token_ids: list[list[int]] = [[] for _ in range(n)]  # not yet sent in a stream chunk
        self.prompt_logprobs: list[list | None] = [None] * n

    def step(self, d: TokenDelta) -> tuple[int, str | None, dict[str, Any] | None]:
        """(choice index, text or None when this token completed none, logprobs)."""
        i = self.opts.index_of[d.request_id]
        self.token_ids[i] += d.token_ids
        self.new_token_ids[i] += d.token_ids
        self.prompt_tokens[i], self.completion_tokens[i] = d.num_prompt_tokens, d.num_output_tokens
        self.cached_tokens[i] = d.num_cached_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[i] = d.prompt_logprobs
        text = d.text
        if not self.started[i]:
            self.started[i] = True
            echo = self.opts.echo_text[i]
            if echo is not None:
                text = echo + text
                if self.opts.num_logprobs is not None and d.prompt_logprobs is not None:
                    self._lp_ids[i] += self.opts.prompt_ids[i]
                    self._lp_entries[i] += d.prompt_logprobs
        if self.opts.num_logprobs is not None and d.logprobs is not None:
            self._lp_ids[i] += d.token_ids
            self._lp_entries[i] += d.logprobs
        if d.finished:
            self.finish[i] = (d.finish_reason, d.stop_reason)
        self.text[i] += text
        if not text and not d.finished:
            return i, None, None
        logprobs = None
        if self.opts.num_logprobs is not None:
            logprobs = completion_logprobs(self._lp_ids[i], self._lp_entries[i], self.opts.num_logprobs,
                                           self.offset[i], self.piece, self.opts.tokens_as_ids)
            self._lp_ids[i], self._lp_entries[i] = [], []
            total = self.logprobs[i] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for key in total:
                total[key] += logprobs[key]
            self.logprobs[i] = total
        self.offset[i] += len(text)
        return i, text, logprobs

    def usage(self) -> dict[str, Any]:
        """Each prompt counted once, however many samples it has."""
        n = self.opts.n
        return usage(sum(self.prompt_tokens[::n]), sum(self.completion_tokens), cached_tokens=sum(self.cached_tokens[::n]))


async def completion_stream(stream: RequestStream, acc: CompletionAccumulator) -> AsyncIterator[str]:
    """SSE chunks of a completion: one per token that completed text (no role chunk, and no
    usage-only chunk unless asked: bench clients read ``choices[0]`` of every chunk)."""
    o = acc.opts
    async for d in stream:
        i, text, logprobs = acc.step(d)
        if text is None:
            continue
        reason, stop = acc.finish[i] if d.finished else (None, None)
        c = completion_chunk(o.id, o.created, o.model, i, text, finish_reason=reason, stop_reason=stop,
                             logprobs=logprobs)
        if o.return_token_ids:  # vLLM's: the prompt's ids on a choice's first chunk, each chunk's own ids
            first = len(acc.new_token_ids[i]) == len(acc.token_ids[i])  # none sent yet
            if first:
                c["choices"][0]["prompt_token_ids"] = o.prompt_ids[i]
            c["choices"][0]["token_ids"], acc.new_token_ids[i] = acc.new_token_ids[i], []
        if o.continuous_usage:
            c["usage"] = acc.usage()
        yield sse_data(c)
    if o.include_usage:
        yield sse_data(completion_chunk(o.id, o.created, o.model, None, "", usage_=acc.usage()))


def completion_response(deltas: list[TokenDelta], acc: CompletionAccumulator) -> dict[str, Any]:
    for d in deltas:
        acc.step(d)
    o = acc.opts
    choices = [{"index": i, "text": acc.text[i], "logprobs": acc.logprobs[i], "finish_reason": acc.finish[i][0],
                "stop_reason": acc.finish[i][1]} for i in range(len(acc.text))]
    if o.return_token_ids:
        for i, c in enumerate(choices):
            c["prompt_token_ids"], c["token_ids"] = o.prompt_ids[i], acc.token_ids[i]
    if o.num_prompt_logprobs is not None:
        for i, c in enumerate(choices):
            c["prompt_logprobs"] = prompt_logprobs_body(acc.prompt_logprobs[i] or [], o.num_prompt_logprobs)
    return {"id": o.id, "object": "text_completion", "created": o.created, "model": o.model,
            "choices": choices, "usage": acc.usage()}
