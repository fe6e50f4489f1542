"""The Kimi K2 / Kimi Linear chat format (ChatML-like, k3-model.md §6.2): the renderer.

Turn = ``<|im_{role}|>{name}<|im_middle|>{content}<|im_end|>``. Tool calls are rendered with ids
``functions.{NAME}:{IDX}`` (IDX running over the conversation, as the model was trained), whatever
ids the client used; tool results quote the same ids.
"""

from __future__ import annotations

import json
from typing import Any

from tidal.serve.chat.effort import normalize_effort
from tidal.serve.chat.instructions import (
    response_format_instruction,
    tool_choice_instruction,
)
from tidal.serve.chat.messages import (
    Message,
    call_function,
    call_name,
    content_parts,
    content_text,
    final_to_continue,
    reasoning_of,
    role_of,
)
from tidal.serve.chat.prompt import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, RenderedPrompt, RenderOptions

IM_USER, IM_ASSISTANT, IM_SYSTEM = "<|im_user|>", "<|im_assistant|>", "<|im_system|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EOS = "[EOS]"
# K2.5's image text (vision.md §4), expanded to one pad per merged patch when encoded.
K25_IMAGE_TEXT = f"{MEDIA_BEGIN}image{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"

K2_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
KIMI_LINEAR_DEFAULT_SYSTEM = "You are a helpful assistant"
_ROLE_TOKEN = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT}


class _Writer:
    def __init__(self, think_tokens: bool) -> None:
        self.out = RenderedPrompt()
        self.think_tokens = think_tokens

    def marker(self, marker: str) -> None:
        """``<think>``/``</think>`` are special tokens only where the tokenizer has them."""
        if marker in (THINK_OPEN, THINK_CLOSE) and not self.think_tokens:
            self.out.add_text(marker)
        else:
            self.out.add_special(marker)

    def header(self, role_token: str, name: str) -> None:
        self.marker(role_token)
        self.out.add_text(name)
        self.marker(IM_MIDDLE)

    def turn(self, role_token: str, name: str, body: str | list) -> None:
        self.header(role_token, name)
        self.out.add_content(body, K25_IMAGE_TEXT)
        self.marker(IM_END)


def _arguments_text(call: dict[str, Any]) -> str:
    """A JSON string as the client sent it; a mapping as JSON; none as ``{}``."""
    args = call_function(call).get("arguments")
    if isinstance(args, str) and args:
        return args
    return json.dumps(args or {}, ensure_ascii=False)


def _assistant_head(w: _Writer, msg: Message, thinking: bool) -> None:
    """An assistant turn up to the end of its content (reasoning replayed when thinking is on)."""
    w.header(IM_ASSISTANT, msg.get("name") or "assistant")
    reasoning = reasoning_of(msg)
    if thinking and reasoning.strip():
        w.marker(THINK_OPEN)
        w.out.add_text(reasoning)
        w.marker(THINK_CLOSE)
    w.out.add_text(content_text(msg.get("content")))


def render_k2(
    messages: list[Message],
    opts: RenderOptions,
    default_system: str = K2_DEFAULT_SYSTEM,
    think_tokens: bool = False,
) -> RenderedPrompt:
    """The K2 prompt. Thinking (only an on/off switch here): earlier reasoning is replayed as
    ``<think>…</think>`` before the content; with thinking off a tokenizer that has ``<think>``
    gets an empty ``<think></think>`` after the generation prompt, so the model answers directly.
    ``tool_choice`` and ``response_format`` become a system turn before the generation prompt.
    ``continue_final_message``: the last (assistant) turn is left open after its content; its
    reasoning, if any, is written closed (K2 replies cannot be continued inside ``<think>``)."""
    on = normalize_effort(opts.thinking) != "off"
    final = final_to_continue(messages) if opts.continue_final_message else None
    if final is not None:
        messages = messages[:-1]
    w = _Writer(think_tokens)
    if opts.tools:
        w.turn(IM_SYSTEM, "tool_declare", json.dumps(opts.tools, separators=(",", ":"), ensure_ascii=False))
    if not messages or role_of(messages[0]) != "system":
        w.turn(IM_SYSTEM, "system", default_system)
    ids: dict[str, str] = {}  # client tool-call id -> rendered id
    n_calls = 0
    for msg in messages:
        role = role_of(msg)
        if role in ("system", "user"):
            w.turn(_ROLE_TOKEN[role], msg.get("name") or role, content_parts(msg.get("content")))
        elif role == "assistant":
            _assistant_head(w, msg, on)
            calls = msg.get("tool_calls") or []
            if calls:
                w.marker(SECTION_BEGIN)
                for call in calls:
                    call_id = f"functions.{call_name(call)}:{n_calls}"
                    n_calls += 1
                    if call.get("id"):
                        ids[call["id"]] = call_id
                    w.marker(CALL_BEGIN)
                    w.out.add_text(call_id)
                    w.marker(ARG_BEGIN)
                    w.out.add_text(_arguments_text(call))
                    w.marker(CALL_END)
                w.marker(SECTION_END)
            w.marker(IM_END)
        elif role == "tool":
            call_id = msg.get("tool_call_id") or ""
            body = f"## Return of {ids.get(call_id, call_id)}\n{content_text(msg.get('content'))}"
            w.turn(IM_SYSTEM, msg.get("name") or "tool", body)
        else:
            raise ValueError(f"unknown message role {msg.get('role')!r}")
    for text in (tool_choice_instruction(opts.tool_choice), response_format_instruction(opts.response_format)):
        if text:
            w.turn(IM_SYSTEM, "system", text)
    if final is not None:
        _assistant_head(w, final, on)
    elif opts.add_generation_prompt:
        w.header(IM_ASSISTANT, "assistant")
        if not on and think_tokens:
            w.marker(THINK_OPEN)
            w.marker(THINK_CLOSE)
        w.out.may_think = on and think_tokens
    return w.out
