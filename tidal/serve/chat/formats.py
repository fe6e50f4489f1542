"""The chat formats a checkpoint can speak, each a renderer + a reply parser + stop tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.sampling_params import ChoicePoint
from tidal.serve.chat.constraints import reply_grammar, tool_choice_points
from tidal.serve.chat.events import ParsedReply, ReplyParser
from tidal.serve.chat.k2 import EOS, IM_END, K2_DEFAULT_SYSTEM, render_k2
from tidal.serve.chat.k2_constraints import k2_reply_grammar
from tidal.serve.chat.k2_parser import K2ReplyParser
from tidal.serve.chat.messages import Message
from tidal.serve.chat.prompt import RenderedPrompt, RenderOptions
from tidal.serve.chat.xtml import END_OF_MSG, render_xtml
from tidal.serve.chat.xtml_parser import XtmlReplyParser


@dataclass(frozen=True)
class ChatFormat:
    name: str
    stop_tokens: tuple[str, ...]

    def render(self, messages: list[Message], **options: Any) -> RenderedPrompt:
        """The prompt for OpenAI-style messages. ``options`` are ``RenderOptions`` fields: tools,
        tool_choice, response_format, thinking (off/low/high/max, default max; anything else
        raises ValueError naming the value), add_generation_prompt (default True)."""
        return self._render(messages, RenderOptions(**options))

    def _render(self, messages: list[Message], opts: RenderOptions) -> RenderedPrompt:
        raise NotImplementedError

    def parser(self, thinking: bool = False, make_id: Callable[[int], str] | None = None) -> ReplyParser:
        """A streaming parser for one reply; ``thinking`` = the prompt's ``thinking`` (the reply
        starts inside the reasoning channel)."""
        raise NotImplementedError

    def parse_full(self, text: str, thinking: bool = False,
                   make_id: Callable[[int], str] | None = None) -> ParsedReply:
        return self.parser(thinking, make_id).parse_full(text)

    def reply_grammar(self, prompt: RenderedPrompt, **constraints: Any) -> str | None:
        """The llguidance grammar (JSON text) that holds a reply to ``prompt`` to ``constraints``
        (tools, tool_choice, content, parallel_tool_calls, strict, skeleton); None when they
        constrain nothing (and ``skeleton`` is off, or the format keeps such replies free);
        ValueError naming the problem."""
        raise NotImplementedError

    def reply_choice_points(self, **constraints: Any) -> tuple[ChoicePoint, ...]:
        """Where the reply grammar's tool names are chosen whole by the engine (none by default:
        the token mask decides)."""
        return ()

    def stop_token_ids(self, tokenizer: Any) -> list[int]:
        """Ids of this format's stop tokens that the tokenizer has."""
        return [tokenizer.special_tokens[t] for t in self.stop_tokens if t in tokenizer.special_tokens]


@dataclass(frozen=True)
class K3Format(ChatFormat):
    """Kimi-K3 XTML; stops on ``<|end_of_msg|>``."""

    name: str = "kimi_k3"
    stop_tokens: tuple[str, ...] = (END_OF_MSG,)
    other_specials: tuple[str, ...] = ()  # the tokenizer's special tokens a reply parser drops

    def _render(self, messages, opts) -> RenderedPrompt:
        return render_xtml(messages, opts)

    def parser(self, thinking=False, make_id=None) -> ReplyParser:
        return XtmlReplyParser(thinking, make_id, self.other_specials)

    def reply_grammar(self, prompt, **constraints) -> str | None:
        return reply_grammar(thinking=prompt.thinking, **constraints)

    def reply_choice_points(self, **constraints) -> tuple[ChoicePoint, ...]:
        return tool_choice_points(**constraints)


@dataclass(frozen=True)
class K2Format(ChatFormat):
    """Kimi K2 / Kimi Linear; stops on ``<|im_end|>`` and ``[EOS]``."""

    name: str = "kimi_k2"
    stop_tokens: tuple[str, ...] = (IM_END, EOS)
    default_system: str = K2_DEFAULT_SYSTEM
    think_tokens: bool = False  # the tokenizer has <think>/</think> as special tokens
    other_specials: tuple[str, ...] = ()

    def _render(self, messages, opts) -> RenderedPrompt:
        return render_k2(messages, opts, self.default_system, self.think_tokens)

    def parser(self, thinking=False, make_id=None) -> ReplyParser:
        return K2ReplyParser(make_id, self.other_specials)

    def reply_grammar(self, prompt, skeleton: bool = False, **constraints) -> str | None:
        # A K2 reply with nothing declared stays free, as before (the skeleton answers a K3 model's
        # habit; a grammar costs every token and ends a request's speculation).
        return k2_reply_grammar(thinking=prompt.may_think, **constraints)
