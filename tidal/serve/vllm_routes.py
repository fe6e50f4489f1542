"""Two routes vLLM's server has beside the OpenAI ones: ``POST /v1/chat/completions/batch`` (N
conversations in one request, one choice each) and ``POST /invocations`` (SageMaker's single entry
point, dispatched on the body's shape). Both reuse the chat and completion handlers unchanged."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from tidal.serve import openai_api as oai
from tidal.serve import openai_protocol as proto
from tidal.serve.errors import bad_request

StartChat = Callable[[proto.ChatCompletionRequest], Awaitable[tuple[Any, dict[str, oai.ChatAccumulator]]]]
Handler = Callable[[Any, Request], Awaitable[Any]]


async def json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what it is instead."""
    try:
        body = json.loads(await request.body())
    except json.JSONDecodeError as e:
        raise bad_request(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def validated(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``model`` from ``body``; a bad field is the same 400 the route itself would give."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def batch_bodies(body: dict[str, Any]) -> list[proto.ChatCompletionRequest]:
    """One chat request per conversation of a batch body (vLLM's limits: no streaming, no tools, n=1)."""
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations \
            or not all(isinstance(c, list) for c in conversations):
        raise bad_request("messages must be a non-empty list of conversations (each a list of messages)", "messages")
    for name, allowed in (("stream", (None, False)), ("tools", (None, [])), ("n", (None, 1))):
        if body.get(name) not in allowed:
            raise bad_request(f"{name} is not supported by /v1/chat/completions/batch", name)
    return [validated(proto.ChatCompletionRequest, {**body, "messages": c}) for c in conversations]


def merge_batch(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """One chat.completion whose choice i is conversation i's reply; usage summed."""
    merged = {**replies[0], "choices": []}
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for i, reply in enumerate(replies):
        for choice in reply["choices"]:
            merged["choices"].append({**choice, "index": i})
        for key in usage:
            usage[key] += reply["usage"][key]
    merged["usage"] = usage
    return merged


def register(app: FastAPI, start_chat: StartChat, chat: Handler, completions: Handler) -> None:
    from tidal.serve.app import collect

    @app.post("/v1/chat/completions/batch")
    async def chat_batch(request: Request) -> dict[str, Any]:
        bodies = batch_bodies(await json_object(request))
        started = []
        try:
            for b in bodies:  # all submitted before any is awaited: the engine runs them together
                started.append(await start_chat(b))
            replies = [oai.chat_response(await collect(request, stream), accs) for stream, accs in started]
        finally:
            for stream, _ in started:
                stream.close()
        return merge_batch(replies)

    @app.post("/invocations")
    async def invocations(request: Request) -> Any:
        body = await json_object(request)
        if "messages" in body:
            return await chat(validated(proto.ChatCompletionRequest, body), request)
        if "prompt" in body:
            return await completions(validated(proto.CompletionRequest, body), request)
        raise bad_request("an invocation body has `messages` (chat completion) or `prompt` (completion)")
