"""OpenAI protocol: request models (with the vLLM/SGLang extensions bench clients send), their
conversion to :class:`SamplingParams`, and the response/chunk bodies.

Requests are validated by pydantic (errors become 400s); responses are plain dicts, built per
token on the streaming path where a model round-trip would cost more than the JSON itself.
Unknown fields are ignored, as OpenAI-compatible servers do; known fields the engine cannot honour
(penalties, logit bias, n > 1) are rejected rather than ignored. ``tool_choice`` and
``response_format`` become system instructions in the prompt (the chat formats render them); the
engine has no constrained decoding.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tidal.engine.request import Logprob
from tidal.sampling_params import SamplingParams
from tidal.serve.chat import ContentDelta, Event, ReasoningDelta, ReplyParser, ToolCallStart
from tidal.serve.engine_client import EngineError, RequestStream, TokenDelta
from tidal.serve.errors import APIError, bad_request, openai_envelope

logger = logging.getLogger("tidal.serve")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Open(BaseModel):
    """Chat content is handed to the renderer as sent: unknown fields are kept."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionCall(_Open):
    name: str
    arguments: str = ""


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _SamplingFields(_Model):
    """Fields both OpenAI routes share."""

    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise bad_request("n > 1 is not supported; send one request per completion", "n")
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) not in (None, neutral):
                raise bad_request(f"{name} is not supported (only {neutral})", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any],
                        *, skip_special_tokens: bool | None = None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        """The engine's parameters; ``defaults`` (the checkpoint's generation_config) fill the
        sampling fields the request left out."""

        def pick(name: str, fallback: Any) -> Any:
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=float(pick("temperature", 1.0)),
                top_p=float(pick("top_p", 1.0)),
                top_k=int(pick("top_k", -1)),
                min_p=float(pick("min_p", 0.0)),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as e:
            raise bad_request(str(e).removeprefix("SamplingParams.")) from e


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if self.continue_final_message:
            raise bad_request("continue_final_message is not supported by the Kimi chat formats",
                              "continue_final_message")

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat renderers take them (OpenAI-shaped dicts, as sent)."""
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens`` (what bench clients send) wins over the older ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request("best_of > 1 is not supported", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of text or token-id prompts."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out or any(len(x) == 0 for x in out):
            raise bad_request("the prompt is empty", "prompt")
        return out


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


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


def _token_str(tid: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{tid}"


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                  token_bytes: Callable[[int], bytes] | None = None) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat response for these tokens. ``bytes`` are the token's own
    bytes when the tokenizer knows them (a byte-level token's text alone may be U+FFFD)."""

    def item(tid: int, lp: Logprob) -> dict[str, Any]:
        tok = _token_str(tid, lp)
        raw = token_bytes(tid) if token_bytes is not None else tok.encode("utf-8")
        return {"token": tok, "logprob": max(lp.logprob, -9999.0), "bytes": list(raw)}

    content = []
    for tid, entry in zip(token_ids, entries):
        content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, v) for t, v in _top(entry, k)]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int,
                        text_offset: int, piece: Callable[[int], str]) -> dict[str, Any]:
    """``choices[].logprobs`` of a completion (the legacy parallel-list shape). ``piece`` names a
    token that has no entry (the first prompt token, when echoing)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            tokens.append(piece(tid))
            token_lps.append(None)
            tops.append(None)
        else:
            lp = entry[tid]
            tokens.append(_token_str(tid, lp))
            token_lps.append(max(lp.logprob, -9999.0))
            top: dict[str, float] = {}
            for t, v in _top(entry, k):  # tokens with the same text: the likelier one stays
                top.setdefault(_token_str(t, v), max(v.logprob, -9999.0))
            tops.append(top)
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any] | None, *,
               finish_reason: str | None = None, stop_reason: int | str | None = None,
               logprobs: dict[str, Any] | None = None, usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` makes the usage-only chunk (``choices: []``)."""
    choices = [] if delta is None else [{
        "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
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


class ChatAccumulator:
    """Feeds one request's token deltas through the format's reply parser. Each ``step`` gives the
    OpenAI delta for that token (None while a marker is still unresolved or the token completed
    no text) with the logprobs of every token since the last delta; it also keeps the counts."""

    def __init__(self, parser: ReplyParser, opts: ChatOptions) -> None:
        self.parser = parser
        self.opts = opts
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._lp_ids: list[int] = []
        self._lp_entries: list[dict[int, Logprob]] = []
        self.all_logprobs: list[dict[str, Any]] = []

    def step(self, d: TokenDelta) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(delta, logprobs) for this engine delta."""
        self.prompt_tokens, self.completion_tokens = d.num_prompt_tokens, d.num_output_tokens
        self.cached_tokens = d.num_cached_tokens
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
            logprobs = chat_logprobs(self._lp_ids, self._lp_entries, self.opts.num_logprobs, self.opts.token_bytes)
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


async def chat_stream(stream: RequestStream, acc: ChatAccumulator) -> AsyncIterator[str]:
    """SSE chunks of a chat completion: a role delta, then one chunk per token that completed text
    (the last one carrying finish_reason), then the usage-only chunk when asked for."""
    o = acc.opts

    def chunk(delta: dict[str, Any], **kw: Any) -> str:
        c = chat_chunk(o.id, o.created, o.model, delta, **kw)
        if o.continuous_usage:
            c["usage"] = acc.usage()
        return sse_data(c)

    yield chunk({"role": "assistant", "content": ""})
    async for d in stream:
        delta, logprobs = acc.step(d)
        if delta is None:
            continue
        if d.finished:
            yield chunk(delta, logprobs=logprobs, finish_reason=acc.finish_reason, stop_reason=acc.stop_reason)
        else:
            yield chunk(delta, logprobs=logprobs)
    if o.include_usage:
        yield sse_data(chat_chunk(o.id, o.created, o.model, None, usage_=acc.usage()))


def chat_response(deltas: list[TokenDelta], acc: ChatAccumulator) -> dict[str, Any]:
    for d in deltas:
        acc.step(d)
    o = acc.opts
    return {
        "id": o.id, "object": "chat.completion", "created": o.created, "model": o.model,
        "choices": [{
            "index": 0, "message": acc.message(),
            "logprobs": {"content": acc.all_logprobs} if o.num_logprobs is not None else None,
            "finish_reason": acc.finish_reason, "stop_reason": acc.stop_reason,
        }],
        "usage": acc.usage(),
    }


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

    def step(self, d: TokenDelta) -> tuple[int, str | None, dict[str, Any] | None]:
        """(choice index, text or None when this token completed none, logprobs)."""
        i = self.opts.index_of[d.request_id]
        self.prompt_tokens[i], self.completion_tokens[i] = d.num_prompt_tokens, d.num_output_tokens
        self.cached_tokens[i] = d.num_cached_tokens
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
                                           self.offset[i], self.piece)
            self._lp_ids[i], self._lp_entries[i] = [], []
            total = self.logprobs[i] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for key in total:
                total[key] += logprobs[key]
            self.logprobs[i] = total
        self.offset[i] += len(text)
        return i, text, logprobs

    def usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt_tokens), sum(self.completion_tokens), cached_tokens=sum(self.cached_tokens))


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
    return {"id": o.id, "object": "text_completion", "created": o.created, "model": o.model,
            "choices": choices, "usage": acc.usage()}
