"""System instructions a request adds to the prompt: ``tool_choice`` and ``response_format``
(k3-chat-format.md, order items 4 and 5), and the fenced JSON both formats use for schemas."""

from __future__ import annotations

import json
from typing import Any


def sorted_json(value: Any) -> str:
    """Compact JSON, every mapping's keys sorted at every level, non-ASCII kept."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fenced_json(value: Any) -> str:
    return "```json\n" + sorted_json(value) + "\n```"


def tool_choice_instruction(tool_choice: Any) -> str | None:
    """None for ``auto`` (or no choice); a MUST / MUST NOT sentence for ``required`` / ``none``;
    for a named function (not covered by the spec) the same form naming the tool."""
    if tool_choice is None or tool_choice == "auto":
        return None
    if tool_choice == "required":
        return "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
    if tool_choice == "none":
        return "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name:
            return (f"The system is invoked with `tool_choice={name}`.\n"
                    f"You MUST call the tool `{name}` in the next message.")
    raise ValueError(f"unsupported tool_choice {tool_choice!r}")


def response_format_instruction(response_format: dict[str, Any] | None) -> str | None:
    """None for plain text; raw-JSON instructions for ``json_object`` / ``json_schema`` (the
    latter with the key-sorted schema fenced)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("The system is invoked with `response_format=json_object`.\n"
                "You MUST answer with a raw JSON object: no code fences, no other text.")
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema", spec) if isinstance(spec, dict) else spec
        return ("The system is invoked with `response_format=json_schema`.\n"
                "You MUST answer with raw JSON that matches this JSON schema: no code fences, "
                "no other text.\n\n" + fenced_json(schema))
    raise ValueError(f"unsupported response_format type {kind!r}")
