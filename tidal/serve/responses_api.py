"""``POST /v1/responses``: OpenAI's Responses API (what the Agents SDK and Codex-style agents call).

A request's ``input`` items (messages, ``function_call``, ``function_call_output``, ``reasoning``)
and ``instructions`` become the chat messages the chat format renders; the reply's parser events
become output items (``reasoning``, ``message`` with ``output_text``, ``function_call``), whole or
as the streamed ``response.*`` events. Responses are kept in memory (the newest
``MAX_STORED_RESPONSES``) so a later request can continue one with ``previous_response_id``;
``instructions`` are not carried over, as OpenAI does.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from tidal.sampling_params import SamplingParams
from tidal.serve.chat import ContentDelta, Event, ReasoningDelta, ReplyParser, ToolCallStart
from tidal.serve.engine_client import EngineError, EngineRequest, RequestStream, TokenDelta
from tidal.serve.errors import APIError, bad_request, openai_envelope
from tidal.serve.openai_protocol import response_format_constraint

MAX_STORED_RESPONSES = 1024


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ReasoningConfig(_Model):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Model):
    model: str | None = None  # as vLLM: none names the served model
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    user: str | None = None
    ignore_eos: bool = False

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        def pick(name: str, fallback: Any) -> Any:
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        return SamplingParams(max_tokens=self.max_output_tokens, temperature=float(pick("temperature", 1.0)),
                              top_p=float(pick("top_p", 1.0)), top_k=int(defaults.get("top_k", -1)),
                              ignore_eos=self.ignore_eos, skip_special_tokens=False)


# ---- input items -> chat messages -------------------------------------------------------------------

def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (``input_text``/``output_text``/``text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of parts", where)
    out = []
    for part in content:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            out.append(part.get("text") or "")
        elif kind == "refusal":
            out.append(part.get("refusal") or "")
        else:
            raise bad_request(f"{where}: content part type {kind!r} is not supported", where)
    return "".join(out)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as OpenAI chat messages: function calls join the assistant turn they
    follow (or start one), reasoning items become the next assistant turn's reasoning."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant() -> dict[str, Any]:
        if not out or out[-1]["role"] != "assistant" or out[-1].get("_closed"):
            out.append({"role": "assistant", "content": ""})
        msg = out[-1]
        if reasoning:
            msg["reasoning_content"] = msg.get("reasoning_content", "") + "".join(reasoning)
            reasoning.clear()
        return msg

    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}: unknown role {role!r}", f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                msg = assistant()
                if msg.get("tool_calls"):  # text after calls is a new turn
                    msg["_closed"] = True
                    msg = assistant()
                msg["content"] += text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            msg = assistant()
            msg.setdefault("tool_calls", []).append({
                "id": item.get("call_id") or item.get("id"), "type": "function",
                "function": {"name": item.get("name") or "", "arguments": item.get("arguments") or ""}})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append(_text(parts, f"{where}.content"))
        else:
            raise bad_request(f"{where}: input item type {kind!r} is not supported", f"{where}.type")
    for msg in out:
        msg.pop("_closed", None)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools (the Responses shape is flat: ``{"type": "function", "name", ...}``)."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise bad_request(f"tool type {t.get('type')!r} is not supported (only function tools)", f"tools.{i}")
        if not t.get("name"):
            raise bad_request("a function tool needs a name", f"tools.{i}.name")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        for key in ("description", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format_of(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` (json_schema's fields inline) in chat's ``response_format`` shape."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise bad_request("text.format must be text, json_object, or json_schema with a schema", "text.format")


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the chat messages of the turn they make."""
    return input_messages([{k: v for k, v in item.items() if k != "id"} for item in output])


# ---- reply -> output items and events ---------------------------------------------------------------

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputBuilder:
    """Parser events -> output items, and the stream events that build them. One item is open at
    a time: a new kind (reasoning, message, each function call) closes the previous one."""

    items: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    _open: dict[str, Any] | None = None
    # Reasoning that is blank so far: OpenAI emits a reasoning item only where there is reasoning,
    # so the item opens with the first non-blank text (carrying this) and is never made without it.
    _blank_reasoning: str = ""

    def event(self, kind: str, **data: Any) -> str:
        data = {"type": kind, **data, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _start(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self._open = item
        self.items.append(item)
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item={**item, "status": "in_progress"}))
        return out

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def feed(self, events: list[Event]) -> list[str]:
        out: list[str] = []
        for ev in events:
            item = self._open
            if isinstance(ev, ReasoningDelta):
                text = ev.text
                if item is None or item["type"] != "reasoning":
                    if not (self._blank_reasoning + text).strip():
                        self._blank_reasoning += text
                        continue
                    text, self._blank_reasoning = self._blank_reasoning + text, ""
                    out += self._start({"type": "reasoning", "id": _id("rs"), "summary": [],
                                        "content": [{"type": "reasoning_text", "text": ""}]})
                    item = self._open
                item["content"][0]["text"] += text
                out.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                      delta=text))
                continue
            self._blank_reasoning = ""
            if isinstance(ev, ContentDelta):
                if item is None or item["type"] != "message":
                    out += self._start({"type": "message", "id": _id("msg"), "role": "assistant", "content": []})
                    item = self._open
                    item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": []}))
                item["content"][0]["text"] += ev.text
                out.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                      delta=ev.text, logprobs=[]))
            elif isinstance(ev, ToolCallStart):
                out += self._start({"type": "function_call", "id": _id("fc"), "call_id": ev.id, "name": ev.name,
                                    "arguments": ""})
            else:
                item["arguments"] += ev.arguments
                out.append(self.event("response.function_call_arguments.delta", **self._where(),
                                      delta=ev.arguments))
        return out

    def close(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        out = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=item))
        return out


@dataclass
class ResponseState:
    """One response as it is built: the request's echo fields, the parser and the counts."""

    id: str
    body: ResponsesRequest
    parser: ReplyParser
    history: list[dict[str, Any]]  # the conversation rendered (instructions excluded)
    effort: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    builder: OutputBuilder = field(default_factory=OutputBuilder)
    last: TokenDelta | None = None
    reasoning_tokens: int = 0

    def step(self, d: TokenDelta) -> list[str]:
        self.last = d
        if self.parser.in_reasoning:
            self.reasoning_tokens += len(d.token_ids)
        events = self.parser.feed(d.text) if d.text else []
        if d.finished:
            events += self.parser.finish()
        return self.builder.feed(events)

    def response(self, status: str | None = None) -> dict[str, Any]:
        b, d = self.body, self.last
        if status is None:
            status = "incomplete" if d is not None and d.finish_reason == "length" else "completed"
        usage = None
        if d is not None:
            usage = {"input_tokens": d.num_prompt_tokens, "input_tokens_details": {"cached_tokens": d.num_cached_tokens},
                     "output_tokens": d.num_output_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": d.num_prompt_tokens + d.num_output_tokens}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": b.model, "output": self.builder.items if status != "in_progress" else [],
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "instructions": b.instructions, "metadata": b.metadata or {},
            "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": b.parallel_tool_calls if b.parallel_tool_calls is not None else True,
            "temperature": b.temperature, "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "text": b.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": b.store,
            "usage": usage,
        }


class ResponseStore:
    """The newest ``capacity`` stored responses: id -> the conversation including its output."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        self._items[response_id] = conversation
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        if response_id not in self._items:
            raise APIError(404, f"no stored response {response_id!r} (responses are kept in memory, the newest "
                                f"{self.capacity})", code="response_not_found", param="previous_response_id")
        return list(self._items[response_id])


def register(app: FastAPI, st: Any) -> None:
    """Add ``POST /v1/responses`` to ``app`` over the server state ``st`` (see app.ServerState)."""
    from tidal.serve.app import collect, sse_response

    store = ResponseStore()
    defaults = st.config.generation_defaults

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        body.model = body.model or st.model_name
        st.check_model(body.model)
        history = store.get(body.previous_response_id) if body.previous_response_id else []
        history += input_messages(body.input)
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
        level = st.chat_effort(body.reasoning.effort if body.reasoning else None)
        tools, tool_choice, fmt = chat_tools(body.tools), chat_tool_choice(body.tool_choice), response_format_of(body.text)
        prompt, ids = await st.render(messages, level=level, tools=tools, tool_choice=tool_choice, response_format=fmt)
        try:
            params = body.sampling_params(defaults)
        except ValueError as e:
            raise bad_request(str(e).removeprefix("SamplingParams.")) from e
        params.stop_token_ids = [*params.stop_token_ids, *st.chat_stop_ids(params.ignore_eos)]
        # tools, tool_choice and text.format are enforced by the chat format's reply grammar
        spec = st.reply_constraint(prompt, tools=tools, tool_choice=tool_choice, content=response_format_constraint(fmt),
                                   parallel_tool_calls=body.parallel_tool_calls, skeleton=not params.ignore_eos)
        await st.constrain(params, spec, "tool_choice")
        rid = _id("resp")
        stream = await st.submit([EngineRequest(rid, ids, params)], max_tokens_param="max_output_tokens")
        state = ResponseState(rid, body, st.chat.parser(prompt.thinking), history, level)
        if body.stream:
            return sse_response(_stream(stream, state, store))
        for d in await collect(request, stream):
            state.step(d)
        state.builder.close()
        _keep(store, state)
        return state.response()


def _keep(store: ResponseStore, state: ResponseState) -> None:
    if state.body.store:
        store.put(state.id, state.history + output_messages(state.builder.items))


async def _stream(stream: RequestStream, state: ResponseState, store: ResponseStore) -> AsyncIterator[str]:
    b = state.builder
    try:
        yield b.event("response.created", response=state.response("in_progress"))
        yield b.event("response.in_progress", response=state.response("in_progress"))
        async for d in stream:
            for event in state.step(d):
                yield event
        for event in b.close():
            yield event
        _keep(store, state)
        final = state.response()
        yield b.event("response.completed" if final["status"] == "completed" else "response.incomplete",
                      response=final)
    except Exception as e:  # noqa: BLE001 - the status is sent: the error goes in the stream
        err = APIError(503, str(e)) if isinstance(e, EngineError) else APIError(500, f"{type(e).__name__}: {e}")
        yield b.event("error", **openai_envelope(err)["error"])
    finally:
        stream.close()
