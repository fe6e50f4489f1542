"""Reading OpenAI-style chat messages: content strings or parts, reasoning, tool calls."""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]

_IMAGE_PARTS = {"image", "image_url", "input_image"}


def content_text(content: Any, image_text: str | None = None) -> str:
    """A message's content as text: a string as is, text parts concatenated, image parts replaced
    by ``image_text`` (an error where the format has no image placeholder)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string or a list of parts, not {type(content).__name__}")
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
            continue
        kind = part.get("type")
        if is_image_part(part):
            if image_text is None:
                raise ValueError("this chat format does not take image content")
            out.append(image_text)
        elif "text" in part:
            out.append(part["text"] or "")
        else:
            raise ValueError(f"unsupported content part type {kind!r}")
    return "".join(out)


def is_image_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    return kind in _IMAGE_PARTS or (kind is None and ("image_url" in part or "image" in part))


def content_parts(content: Any) -> list[str | dict[str, Any]]:
    """A message's content as text runs and image parts, in order (text parts merged)."""
    if not isinstance(content, list):
        return [content_text(content)]
    out: list[str | dict[str, Any]] = []
    for part in content:
        if is_image_part(part):
            out.append(part)
        else:
            text = content_text([part])
            if out and isinstance(out[-1], str):
                out[-1] += text
            else:
                out.append(text)
    return out


def final_to_continue(messages: list[Message]) -> Message:
    """The assistant message that ``continue_final_message`` leaves open (the reply continues its
    text); ValueError when the last message cannot be continued."""
    last = messages[-1] if messages else {}
    if role_of(last) != "assistant":
        raise ValueError(f"continue_final_message continues the last message, which must be the assistant's, "
                         f"not {last.get('role')!r}")
    if last.get("tool_calls"):
        raise ValueError("continue_final_message cannot continue an assistant message with tool_calls")
    return last


def role_of(msg: Message) -> str:
    """The message role; ``developer`` is the newer name for ``system``."""
    role = msg.get("role")
    return "system" if role == "developer" else str(role)


def reasoning_of(msg: Message) -> str:
    """An assistant turn's reasoning (``reasoning_content`` or vLLM's ``reasoning``)."""
    value = msg.get("reasoning_content")
    if value is None:
        value = msg.get("reasoning")
    return value or ""


def call_function(call: dict[str, Any]) -> dict[str, Any]:
    """The ``function`` of an OpenAI tool call (or the call itself when given flat)."""
    return call.get("function") or call


def call_name(call: dict[str, Any]) -> str:
    return call_function(call).get("name") or ""


def call_arguments(call: dict[str, Any]) -> dict[str, Any] | str | None:
    """A call's arguments: a mapping where they are (or decode to) a JSON object, the raw string
    where they do not, None where there are none."""
    args = call_function(call).get("arguments")
    if args is None or args == "":
        return None
    if isinstance(args, dict):
        return args
    if not isinstance(args, str):
        raise ValueError(f"tool call arguments must be a JSON string or an object, not {type(args).__name__}")
    try:
        value = json.loads(args)
    except ValueError:
        return args
    return value if isinstance(value, dict) else args
