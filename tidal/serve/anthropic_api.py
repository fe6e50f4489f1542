"""Anthropic Messages protocol: request models, their conversion to the OpenAI-shaped messages the
chat formats render, and the response / stream-event bodies.

Thinking: a request without ``thinking`` (or with ``{"type": "disabled"}``) renders K3's
no-thinking prompt, so the reply has no thinking block; with ``enabled``/``adaptive`` the level
comes from ``output_config.effort`` or ``budget_tokens`` (the table in :mod:`tidal.serve.chat.effort`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tidal.sampling_params import SamplingParams, StructuredOutputsParams
from tidal.serve.chat import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ReplyParser,
    ToolCallStart,
    budget_effort,
    request_effort,
    thinking_effort,
)
from tidal.serve.engine_client import EngineError, RequestStream, TokenDelta
from tidal.serve.errors import APIError, anthropic_envelope, bad_request

logger = logging.getLogger("tidal.serve")

ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort; mapped by chat.effort
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicTool(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputConfig(_Model):
    effort: str | None = None
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": {...}}


class AnthropicMessage(_Model):
    role: str
    content: str | list[dict[str, Any]]


class MessagesRequest(_Model):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    ignore_eos: bool = False

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """Special tokens stay in the text: the reply parser needs the markers."""

        def pick(name: str, fallback: Any) -> Any:
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        try:
            return SamplingParams(
                max_tokens=self.max_tokens, temperature=float(pick("temperature", 1.0)),
                top_p=float(pick("top_p", 1.0)), top_k=int(pick("top_k", -1)), stop=self.stop_sequences or None,
                ignore_eos=self.ignore_eos, skip_special_tokens=False,
            )
        except ValueError as e:
            raise bad_request(str(e).removeprefix("SamplingParams.")) from e


class CountTokensRequest(_Model):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---- request -> chat-format inputs ------------------------------------------------------------------

def _text_of(content: Any, where: str) -> str:
    """Text blocks (or a string) joined; images and documents are not supported."""
    if isinstance(content, str):
        return content
    out = []
    for block in content or []:
        kind = block.get("type")
        if kind == "text":
            out.append(block.get("text") or "")
        else:
            raise bad_request(f"content block type {kind!r} is not supported in {where}", where)
    return "".join(out)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An Anthropic ``image`` block as an OpenAI ``image_url`` part (base64 -> a data: URL)."""
    source = block.get("source") or {}
    kind = source.get("type")
    if kind == "base64":
        media = source.get("media_type") or "application/octet-stream"
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source.get('data') or ''}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad_request(f"image source type {kind!r} is not supported (use base64 or url)", where)


def to_chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic messages as OpenAI-shaped messages: ``tool_result`` blocks become ``tool``
    messages (before the user's own text, as they answer the previous turn), ``tool_use`` blocks
    become ``tool_calls`` and ``thinking`` blocks ``reasoning_content``. Roles other than
    user/assistant (Claude Code sends some) are read as user."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, msg in enumerate(req.messages):
        role = "assistant" if msg.role == "assistant" else "user"
        if isinstance(msg.content, str):
            out.append({"role": role, "content": msg.content})
            continue
        texts, reasoning, calls, results = [], [], [], []
        parts: list[dict[str, Any]] = []  # text and image parts in order, when the message has images
        for block in msg.content:
            kind = block.get("type")
            if kind == "text":
                texts.append(block.get("text") or "")
                parts.append({"type": "text", "text": block.get("text") or ""})
            elif kind == "image" and role == "user":
                parts.append(_image_part(block, f"messages.{i}.content"))
            elif kind == "thinking" and role == "assistant":
                reasoning.append(block.get("thinking") or "")
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"), "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                text = _text_of(block.get("content") or "", f"messages.{i}.content (tool_result)")
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            else:
                raise bad_request(f"content block type {kind!r} is not supported in a {msg.role} message",
                                  f"messages.{i}.content")
        out += results
        if role == "assistant":
            m: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if reasoning:
                m["reasoning_content"] = "".join(reasoning)
            if calls:
                m["tool_calls"] = calls
            out.append(m)
        elif any(p["type"] == "image_url" for p in parts):
            out.append({"role": "user", "content": parts})
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def to_chat_tools(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    tools = []
    for t in req.tools:
        if t.type not in (None, "custom"):
            raise bad_request(f"server tool {t.type!r} is not supported", "tools")
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        tools.append({"type": "function", "function": fn})
    return tools


def to_tool_choice(choice: dict[str, Any] | None) -> Any:
    if not choice:
        return None
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(f"unknown tool_choice type {kind!r}", "tool_choice")


def output_format(req: MessagesRequest) -> StructuredOutputsParams | None:
    """``output_config.format``: a JSON schema the text answer follows."""
    fmt = req.output_config.format if req.output_config is not None else None
    if not fmt:
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {type: json_schema, schema: {...}}", "output_config.format")
    return StructuredOutputsParams(json=fmt["schema"])


def effort_of(req: MessagesRequest | CountTokensRequest, default: str) -> str:
    """The request's K3 thinking level. Without ``thinking`` the model does not think (K3's format
    can switch thinking off, so there is no thinking block to drop), unless
    ``chat_template_kwargs`` asks for it. ``enabled``/``adaptive`` think at ``output_config.effort``,
    else at the level ``budget_tokens`` maps to, else at the server's ``default``."""
    kwargs = req.chat_template_kwargs
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None and effort.strip().lower() not in ANTHROPIC_EFFORTS:
        raise bad_request(f"unknown output_config.effort {effort!r}; expected one of "
                          f"{', '.join(ANTHROPIC_EFFORTS)}", "output_config.effort")
    try:
        if req.thinking is None:
            return thinking_effort(None, kwargs, default="off")
        if req.thinking.type == "disabled":
            return "off"
        if effort is not None:
            return request_effort(effort)
        if req.thinking.budget_tokens is not None:
            return budget_effort(req.thinking.budget_tokens)
        return thinking_effort(None, kwargs, default=default)
    except ValueError as e:
        raise bad_request(str(e), "chat_template_kwargs") from e


# ---- responses ----------------------------------------------------------------------------------------

def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """Anthropic's split: ``input_tokens`` are the prompt tokens not read from the cache."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def delta_usage(d: TokenDelta | None, prompt_tokens: int) -> dict[str, Any]:
    if d is None:
        return usage(prompt_tokens, 0)
    return usage(d.num_prompt_tokens, d.num_output_tokens, d.num_cached_tokens)


def stop_reason(finish_reason: str | None, engine_stop: int | str | None, called_tools: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish."""
    if finish_reason == "stop" and isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    if finish_reason == "stop" and called_tools:
        return "tool_use", None
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as the ``input`` object; text that is not a JSON object (a
    reply cut by max_tokens) is kept under ``_raw_arguments`` rather than lost."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def new_tool_id(index: int) -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


@dataclass
class MessagesOptions:
    id: str
    model: str
    prompt_tokens: int


class BlockWriter:
    """Parser events -> ``content_block_start`` / ``content_block_delta`` / ``content_block_stop``
    events: a new block whenever the kind changes (thinking, text, each tool call)."""

    def __init__(self) -> None:
        self.index = -1
        self.current: tuple | None = None

    def _open(self, key: tuple, block: dict[str, Any]) -> list[str]:
        if self.current == key:
            return []
        out = self.close()
        self.index += 1
        self.current = key
        return out + [sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.current is None:
            return []
        self.current = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def events(self, events: list[Event]) -> list[str]:
        out: list[str] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                out += self._open(("thinking",), {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
            elif isinstance(ev, ContentDelta):
                out += self._open(("text",), {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": ev.text}))
            elif isinstance(ev, ToolCallStart):
                out += self._open(("tool", ev.index), {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
            elif self.current == ("tool", ev.index):
                out.append(self._delta({"type": "input_json_delta", "partial_json": ev.arguments}))
        return out


def _feed(parser: ReplyParser, d: TokenDelta) -> list[Event]:
    events = parser.feed(d.text) if d.text else []
    if d.finished:
        events += parser.finish()
    return events


async def messages_stream(stream: RequestStream, parser: ReplyParser, o: MessagesOptions) -> AsyncIterator[str]:
    """The Messages event stream, a content block event per token that completed text.
    ``message_start`` waits for the first token: its usage then knows the prefix-cache hit."""
    try:
        writer = BlockWriter()
        last: TokenDelta | None = None
        async for d in stream:
            if last is None:
                yield sse("message_start", {"type": "message_start", "message": {
                    "id": o.id, "type": "message", "role": "assistant", "model": o.model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": usage(d.num_prompt_tokens, 0, d.num_cached_tokens)}})
            last = d
            for event in writer.events(_feed(parser, d)):
                yield event
        for event in writer.close():
            yield event
        reason, seq = stop_reason(last.finish_reason if last else None, last.stop_reason if last else None,
                                  bool(parser.result.tool_calls))
        yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                    "usage": delta_usage(last, o.prompt_tokens)})
        yield sse("message_stop", {"type": "message_stop"})
    except Exception as e:
        if isinstance(e, EngineError):
            err = APIError(503, str(e))
        else:
            logger.exception("stream failed", exc_info=e)
            err = APIError(500, f"internal server error: {type(e).__name__}: {e}")
        yield sse("error", anthropic_envelope(err))
    finally:
        stream.close()


def messages_response(deltas: list[TokenDelta], parser: ReplyParser, o: MessagesOptions) -> dict[str, Any]:
    for d in deltas:
        _feed(parser, d)
    r = parser.result
    content: list[dict[str, Any]] = []
    if r.reasoning:
        content.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
    if r.content:
        content.append({"type": "text", "text": r.content})
    for call in r.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)})
    last = deltas[-1] if deltas else None
    reason, seq = stop_reason(last.finish_reason if last else None, last.stop_reason if last else None,
                              bool(r.tool_calls))
    return {"id": o.id, "type": "message", "role": "assistant", "model": o.model, "content": content,
            "stop_reason": reason, "stop_sequence": seq,
            "usage": delta_usage(last, o.prompt_tokens)}
