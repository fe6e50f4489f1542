"""Streaming parser of a K3 (XTML) reply.

The reply continues the generation prompt: inside the think channel when thinking is on, else
inside the response channel; then optional ``tools`` with typed ``call``/``argument`` elements,
``<|close|>message<|sep|>`` and ``<|end_of_msg|>``. Elements are tracked on a stack; a tag that
does not fit where it appears is malformed and kept as text of the channel it appeared in.
Typed arguments stream out as JSON: a string value as a JSON string, piece by piece; any other
type decoded once complete (a value that is not JSON becomes a JSON string).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import regex

from tidal.serve.chat.events import ReplyParser
from tidal.serve.chat.scanner import MarkerScanner
from tidal.serve.chat.xtml import (
    CLOSE,
    END_OF_MSG,
    OPEN,
    SEP,
    compact_json,
    unescape_attr,
)

_OPEN_HEADER = regex.compile(r'[A-Za-z][\w.-]*(?: [\w.-]+="[^"]*")*')
_CLOSE_HEADER = regex.compile(r"[A-Za-z][\w.-]*")
_ATTR = regex.compile(r' ([\w.-]+)="([^"]*)"')
_CHANNELS = ("think", "response", "tools")


@dataclass
class _Call:
    index: int
    mode: str | None = None  # None (no arguments yet), "args" (typed arguments) or "json"


@dataclass
class _Argument:
    typed: bool  # any type but string: buffered, decoded at the close
    value: str = ""


class XtmlReplyParser(ReplyParser):
    def __init__(self, thinking: bool, make_id: Callable[[int], str] | None = None) -> None:
        super().__init__(make_id)
        self._scanner = MarkerScanner([OPEN, CLOSE, SEP, END_OF_MSG])
        self._stack = ["message", "think" if thinking else "response"]
        self._fresh = True  # nothing seen yet: a leading message/channel open is accepted
        self._header: str | None = None  # text after <|open|>/<|close|>, waiting for <|sep|>
        self._header_kind = OPEN
        self._stray = ""  # text between elements, resolved at the next element
        self._call: _Call | None = None
        self._arg: _Argument | None = None

    @property
    def in_reasoning(self) -> bool:
        return bool(self._stack) and self._stack[-1] == "think"

    # --- input ----------------------------------------------------------------------------------
    def _feed(self, text: str) -> None:
        for piece, is_marker in self._scanner.feed(text):
            if is_marker:
                self._marker(piece)
            else:
                self._text(piece)

    def _finish(self) -> None:
        self._text(self._scanner.flush())
        if self._header is not None:
            self._abandon_header()
        if self._arg is not None and self._arg.typed:
            self._arguments(self._call.index, self._arg.value)  # cut off: pass on what came
            self._arg = None
        self._flush_stray()

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._header is None:
            self._channel_text(text)
            return
        self._header += text
        pattern = _OPEN_HEADER if self._header_kind == OPEN else _CLOSE_HEADER
        if pattern.fullmatch(self._header, partial=True) is None:
            self._abandon_header()

    def _marker(self, marker: str) -> None:
        if self._header is not None:
            if marker == SEP:
                self._complete_header()
                return
            self._abandon_header()
        if marker in (OPEN, CLOSE):
            self._header, self._header_kind = "", marker
        elif marker == END_OF_MSG:
            self._flush_stray()
            self._pop_to(0)
        else:  # a stray <|sep|>
            self._channel_text(marker)

    def _abandon_header(self) -> None:
        raw, self._header = self._header_kind + self._header, None
        self._channel_text(raw)

    def _complete_header(self) -> None:
        header, self._header = self._header, None
        raw = self._header_kind + header + SEP
        pattern = _OPEN_HEADER if self._header_kind == OPEN else _CLOSE_HEADER
        if pattern.fullmatch(header) is None:
            self._channel_text(raw)
            return
        tag = header.split(" ", 1)[0]
        attrs = {k: unescape_attr(v) for k, v in _ATTR.findall(header[len(tag):])}
        ok = self._open(tag, attrs) if self._header_kind == OPEN else self._close(tag)
        if not ok:
            self._channel_text(raw)
        self._fresh = False

    # --- structure ------------------------------------------------------------------------------
    def _open(self, tag: str, attrs: dict[str, str]) -> bool:
        top = self._stack[-1] if self._stack else None
        if self._fresh and tag == "message" and top is not None:
            self._stack = ["message"]
            return True
        if tag in _CHANNELS and top in ("message", "think", "response"):
            self._flush_stray()
            if top != "message":
                self._stack.pop()  # the next channel ends the current one
            self._stack.append(tag)
            return True
        if tag == "call" and top == "tools":
            self._flush_stray()
            self._call = _Call(self._start_call(attrs.get("tool", "")))
            self._stack.append("call")
            return True
        if tag == "argument" and top == "call" and self._call.mode != "json":
            self._flush_stray()
            lead = "{" if self._call.mode is None else ","
            typed = attrs.get("type", "string") != "string"
            self._arguments(self._call.index, lead + compact_json(attrs.get("key", "")) + ":" + ("" if typed else '"'))
            self._call.mode = "args"
            self._arg = _Argument(typed)
            self._stack.append("argument")
            return True
        if tag == "json" and top == "call" and self._call.mode is None:
            self._flush_stray()
            self._call.mode = "json"
            self._stack.append("json")
            return True
        return False

    def _close(self, tag: str) -> bool:
        if tag not in self._stack:
            return False
        self._flush_stray()
        self._pop_to(len(self._stack) - 1 - self._stack[::-1].index(tag))
        return True

    def _pop_to(self, depth: int) -> None:
        """Close every open element from the top down to (and including) ``stack[depth]``."""
        while len(self._stack) > depth:
            tag = self._stack.pop()
            if tag == "argument":
                self._end_argument()
            elif tag == "call":
                self._end_call()

    def _end_argument(self) -> None:
        arg, self._arg = self._arg, None
        if not arg.typed:
            self._arguments(self._call.index, '"')
            return
        try:
            value = compact_json(json.loads(arg.value))
        except ValueError:
            value = compact_json(arg.value)
        self._arguments(self._call.index, value)

    def _end_call(self) -> None:
        call, self._call = self._call, None
        if call.mode is None:
            self._arguments(call.index, "{}")
        elif call.mode == "args":
            self._arguments(call.index, "}")

    # --- text -----------------------------------------------------------------------------------
    def _channel_text(self, text: str) -> None:
        top = self._stack[-1] if self._stack else None
        if top == "think":
            self._reasoning(text)
        elif top == "response":
            self._content(text)
        elif top == "argument":
            if self._arg.typed:
                self._arg.value += text
            else:
                self._arguments(self._call.index, compact_json(text)[1:-1])
        elif top == "json":
            self._arguments(self._call.index, text)
        else:
            self._stray += text
        if text.strip():
            self._fresh = False

    def _flush_stray(self) -> None:
        """Text between elements: whitespace is dropped, anything else kept as content."""
        stray, self._stray = self._stray, ""
        if stray.strip():
            self._content(stray)
