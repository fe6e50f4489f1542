"""Chat formats, chosen from the checkpoint: render OpenAI-style messages into a prompt, parse the
model's reply (streaming) into reasoning, content and tool calls.

    fmt = chat_format_for(tokenizer, config)
    prompt = fmt.render(messages, tools=tools, thinking=thinking_effort(req.reasoning_effort))
    ids = prompt.token_ids(tokenizer)            # markers -> special ids, text never does
    parser = fmt.parser(prompt.thinking)
    for delta in text_deltas: events = parser.feed(delta)   # ReasoningDelta, ContentDelta, ...
    events = parser.finish(); parser.result.finish_reason
"""

from __future__ import annotations

from typing import Any

from tidal.serve.chat.effort import (
    DEFAULT_EFFORT,
    EFFORTS,
    REQUEST_EFFORTS,
    budget_effort,
    normalize_effort,
    request_effort,
    thinking_effort,
)
from tidal.serve.chat.events import (
    ContentDelta,
    Event,
    ParsedReply,
    ReasoningDelta,
    ReplyParser,
    ToolCall,
    ToolCallDelta,
    ToolCallStart,
)
from tidal.serve.chat.formats import ChatFormat, K2Format, K3Format
from tidal.serve.chat.k2 import K2_DEFAULT_SYSTEM, KIMI_LINEAR_DEFAULT_SYSTEM
from tidal.serve.chat.prompt import RenderedPrompt, RenderOptions, Segment
from tidal.serve.chat.xtml import OPEN

__all__ = [
    "DEFAULT_EFFORT", "EFFORTS", "REQUEST_EFFORTS", "ChatFormat", "ContentDelta", "Event", "K2Format", "K3Format", "ParsedReply", "ReasoningDelta",
    "RenderOptions", "RenderedPrompt", "ReplyParser", "Segment", "ToolCall", "ToolCallDelta", "ToolCallStart", "chat_format_for",
    "budget_effort", "normalize_effort", "request_effort", "thinking_effort",
]


def chat_format_for(tokenizer: Any, config: Any = None) -> ChatFormat:
    """K3 XTML when the tokenizer has ``<|open|>``, else the K2 format (with Kimi Linear's default
    system prompt when ``config`` — a ModelConfig or config dict — says ``kimi_linear``)."""
    specials = tokenizer.special_tokens
    names = tuple(sorted(specials))
    if OPEN in specials:
        return K3Format(other_specials=names)
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    system = KIMI_LINEAR_DEFAULT_SYSTEM if model_type == "kimi_linear" else K2_DEFAULT_SYSTEM
    return K2Format(default_system=system, think_tokens="<think>" in specials, other_specials=names)
