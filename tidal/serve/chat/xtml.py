"""Kimi-K3's "XTML" chat format: the renderer (k3-chat-format.md, followed to the letter).

Only ``<|open|>``, ``<|close|>``, ``<|sep|>`` and ``<|end_of_msg|>`` are special tokens; tag
names, attributes and bodies are ordinary text, and nothing is inserted between elements.
"""

from __future__ import annotations

import json
from typing import Any

from tidal.serve.chat.effort import normalize_effort
from tidal.serve.chat.instructions import (
    fenced_json,
    response_format_instruction,
    tool_choice_instruction,
)
from tidal.serve.chat.messages import (
    Message,
    call_arguments,
    call_name,
    content_parts,
    final_to_continue,
    reasoning_of,
    role_of,
)
from tidal.serve.chat.prompt import RenderedPrompt, RenderOptions

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"  # plain text, expanded to media tokens later

TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
NEW_TOOLS_HEADER = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
)
EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)

Attrs = list[tuple[str, str]]


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise ValueError(f"tool call argument of type {type(value).__name__} is not JSON")


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class XtmlWriter:
    """Appends XTML elements to a ``RenderedPrompt``."""

    def __init__(self) -> None:
        self.out = RenderedPrompt()

    def open(self, tag: str, attrs: Attrs = ()) -> None:
        self.out.add_special(OPEN)
        self.out.add_text(tag + "".join(f' {k}="{escape_attr(str(v))}"' for k, v in attrs))
        self.out.add_special(SEP)

    def close(self, tag: str) -> None:
        self.out.add_special(CLOSE)
        self.out.add_text(tag)
        self.out.add_special(SEP)

    def element(self, tag: str, attrs: Attrs, body: str | list) -> None:
        """``body``: text, or text runs and image parts (each image at its place)."""
        self.open(tag, attrs)
        self.out.add_content(body, IMAGE_PLACEHOLDER)
        self.close(tag)

    def message(self, attrs: Attrs, body: str | list = "") -> None:
        self.element("message", attrs, body)
        self.out.add_special(END_OF_MSG)


def _named(role: str, msg: Message) -> Attrs:
    attrs = [("role", role)]
    if msg.get("name"):
        attrs.append(("name", msg["name"]))
    return attrs


def _assistant(w: XtmlWriter, msg: Message, thinking: bool) -> None:
    w.open("message", _named("assistant", msg))
    if thinking:
        reasoning = reasoning_of(msg)
        w.element("think", [], reasoning if reasoning.strip() else "")
    w.element("response", [], content_parts(msg.get("content")))
    calls = msg.get("tool_calls") or []
    if calls:
        w.open("tools")
        for i, call in enumerate(calls, 1):
            w.open("call", [("tool", call_name(call)), ("index", str(i))])
            args = call_arguments(call)
            if isinstance(args, dict):
                for key, value in args.items():
                    kind = json_type(value)
                    w.element("argument", [("key", key), ("type", kind)],
                              value if kind == "string" else compact_json(value))
            elif isinstance(args, str):
                w.element("json", [("type", "object")], args)
            w.close("call")
        w.close("tools")
    w.close("message")
    w.out.add_special(END_OF_MSG)


def _open_assistant(w: XtmlWriter, msg: Message, thinking: bool) -> None:
    """The final assistant message left open (continue_final_message): in its response channel
    after its content, or in its think channel when it has reasoning but no content yet."""
    w.open("message", _named("assistant", msg))
    content = content_parts(msg.get("content"))
    if thinking:
        reasoning = reasoning_of(msg)
        w.open("think")
        w.out.add_text(reasoning if reasoning.strip() else "")
        if content == [""]:
            w.out.thinking = True
            return
        w.close("think")
    w.open("response")
    w.out.add_content(content, IMAGE_PLACEHOLDER)


def _tool_results(w: XtmlWriter, run: list[Message], prev: Message | None) -> None:
    """A run of tool messages: in the order of the preceding assistant's calls when every result
    names one of its call ids, else in their own order."""
    calls = (prev or {}).get("tool_calls") or []
    ids = [c.get("id") for c in calls]
    if calls and all(m.get("tool_call_id") and m.get("tool_call_id") in ids for m in run):
        pos = [ids.index(m["tool_call_id"]) for m in run]
        order = sorted(range(len(run)), key=lambda j: pos[j])
        rows = [(run[j], call_name(calls[pos[j]])) for j in order]
    else:
        rows = [
            (m, m.get("tool") or m.get("name") or (call_name(calls[j]) if j < len(calls) else ""))
            for j, m in enumerate(run)
        ]
    for n, (m, name) in enumerate(rows, 1):
        w.message([("role", "tool"), ("tool", name), ("index", str(n))],
                  content_parts(m.get("content")))


def render_xtml(messages: list[Message], opts: RenderOptions) -> RenderedPrompt:
    """The K3 prompt for OpenAI-style ``messages``."""
    effort = normalize_effort(opts.thinking)
    on = effort != "off"
    w = XtmlWriter()
    final = final_to_continue(messages) if opts.continue_final_message else None
    if final is not None:
        messages = messages[:-1]
    if opts.tools:
        w.message([("role", "system"), ("type", "tool-declare")], TOOLS_HEADER + fenced_json(opts.tools))
    if on:
        w.message([("role", "system"), ("type", "thinking-effort")], EFFORT_TEXT.format(effort=effort).strip())
    i = 0
    while i < len(messages):
        msg = messages[i]
        role = role_of(msg)
        if role == "tool":
            j = i
            while j < len(messages) and role_of(messages[j]) == "tool":
                j += 1
            prev = messages[i - 1] if i > 0 and role_of(messages[i - 1]) == "assistant" else None
            _tool_results(w, messages[i:j], prev)
            i = j
            continue
        if role == "user":
            w.message(_named("user", msg), content_parts(msg.get("content")))
        elif role == "system":
            if msg.get("tools"):
                w.message([("role", "system"), ("type", "tool-declare")],
                          NEW_TOOLS_HEADER + fenced_json(msg["tools"]))
            body = content_parts(msg.get("content"))
            if not msg.get("tools") or any(not isinstance(p, str) or p.strip() for p in body):
                w.message(_named("system", msg), body)
        elif role == "assistant":
            _assistant(w, msg, on)
        else:
            raise ValueError(f"unknown message role {msg.get('role')!r}")
        i += 1
    choice = tool_choice_instruction(opts.tool_choice)
    if choice:
        w.message([("role", "system"), ("type", "tool-choice")], choice)
    fmt = response_format_instruction(opts.response_format)
    if fmt:
        w.message([("role", "system"), ("type", "response-format")], fmt)
    if final is not None:
        _open_assistant(w, final, on)
    elif opts.add_generation_prompt:
        w.open("message", [("role", "assistant")])
        w.open("think" if on else "response")
        w.out.thinking = on
    w.out.image_size_in_header = True
    return w.out
