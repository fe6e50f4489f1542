"""Streaming parser of a K2 / Kimi Linear reply (serving-engines.md §5).

``<think>…</think>`` at the start is reasoning (``◁think▷``/``◁/think▷`` in older models); the
tool section ``<|tool_calls_section_begin|>`` (which also ends reasoning) holds calls
``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>``;
the name comes from the id. A marker where it does not belong is dropped when it is one of the
tokenizer's special tokens (as are its other special tokens), else kept as text; a call cut off
by the end of the reply is dropped (see ReplyParser).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from tidal.serve.chat.events import ReplyParser
from tidal.serve.chat.k2 import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    EOS,
    IM_END,
    SECTION_BEGIN,
    SECTION_END,
    THINK_CLOSE,
    THINK_OPEN,
)
from tidal.serve.chat.scanner import MarkerScanner

_ALIASES = {
    THINK_OPEN: THINK_OPEN, "◁think▷": THINK_OPEN,
    THINK_CLOSE: THINK_CLOSE, "◁/think▷": THINK_CLOSE,
    SECTION_BEGIN: SECTION_BEGIN, "<|tool_call_section_begin|>": SECTION_BEGIN,
    SECTION_END: SECTION_END, "<|tool_call_section_end|>": SECTION_END,
    CALL_BEGIN: CALL_BEGIN, ARG_BEGIN: ARG_BEGIN, CALL_END: CALL_END,
    IM_END: IM_END, EOS: IM_END,
}
_CALL_ID = re.compile(r"(?:functions\.)?(.*?)(?::\d+)?", re.DOTALL)

# States: "lead" (content may follow; leading whitespace waits), "content", "reasoning",
# "section" (between calls), "call_id", "call_args", "done".


class K2ReplyParser(ReplyParser):
    def __init__(self, make_id: Callable[[int], str] | None = None, drop: tuple[str, ...] = ()) -> None:
        super().__init__(make_id)
        self._specials = frozenset(drop)
        self._drop = self._specials - set(_ALIASES)
        self._scanner = MarkerScanner([*_ALIASES, *self._drop])
        self.state = "lead"
        self._seen_content = False
        self._stray = ""  # whitespace-so-far in "lead", text between calls in "section"/"done"
        self._call_id = ""
        self._call: int | None = None
        self._args_started = False

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def _feed(self, text: str) -> None:
        for piece, is_marker in self._scanner.feed(text):
            if is_marker and piece in self._drop:
                continue
            if is_marker:
                self._marker(piece, _ALIASES[piece])
            else:
                self._text(piece)

    def _finish(self) -> None:
        self._text(self._scanner.flush())
        self._call_id = ""  # a call cut off before its arguments: dropped
        self._flush_stray()

    # --- text -----------------------------------------------------------------------------------
    def _text(self, text: str) -> None:
        if not text:
            return
        s = self.state
        if s == "reasoning":
            self._reasoning(text)
        elif s == "content":
            self._content(text)
        elif s == "lead":
            self._stray += text
            if self._stray.strip():
                self.state = "content"
                self._seen_content = True
                self._flush_stray()
        elif s == "call_id":
            self._call_id += text
        elif s == "call_args":
            if not self._args_started:
                text = text.lstrip()
                self._args_started = bool(text)
            self._arguments(self._call, text)
        else:  # section, done
            self._stray += text

    def _flush_stray(self) -> None:
        """Whitespace between elements is dropped, anything else kept as content."""
        stray, self._stray = self._stray, ""
        if stray.strip():
            self._content(stray)

    # --- markers --------------------------------------------------------------------------------
    def _marker(self, raw: str, marker: str) -> None:
        s = self.state
        if marker == IM_END:
            self._call_id = ""
            self._end_call()
            self._flush_stray()
            self.state = "done"
        elif marker == THINK_OPEN and s == "lead" and not self._seen_content and not self.num_calls:
            self._stray = ""
            self.state = "reasoning"
        elif marker == THINK_CLOSE and s == "reasoning":
            self.state = "lead"
        elif marker == SECTION_BEGIN and s in ("lead", "content", "reasoning"):
            self._flush_stray()
            self.state = "section"
        elif marker == CALL_BEGIN and s == "section":
            self._flush_stray()
            self.state, self._call_id = "call_id", ""
        elif marker == ARG_BEGIN and s == "call_id":
            self._begin_call()
            self.state = "call_args"
        elif marker == CALL_END and s in ("call_id", "call_args"):
            if s == "call_id":
                self._begin_call()
            self._end_call()
            self.state = "section"
        elif marker == SECTION_END and s in ("section", "call_id", "call_args"):
            if s == "call_id":
                self._begin_call()
            self._end_call()
            self._flush_stray()
            self.state = "lead"
        elif raw not in self._specials:  # out of place and no special token (``<think>`` as text)
            self._text(raw)

    def _begin_call(self) -> None:
        call_id = self._call_id.strip()
        self._call_id = ""
        name = _CALL_ID.fullmatch(call_id).group(1)
        self._call = self._start_call(name, call_id or None)
        self._args_started = False

    def _end_call(self) -> None:
        if self._call is not None and not self._args_started:
            self._arguments(self._call, "{}")
        self._call = None
        self._commit_call()
