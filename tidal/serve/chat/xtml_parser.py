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
    def __init__(self, thinking: bool, make_id: Callable[[int], str] | None = None,
                 drop: tuple[str, ...] = ()) -> None:
        """``drop``: the tokenizer's other special tokens, removed wherever they appear."""
        super().__init__(make_id)
        self._drop = frozenset(drop) - {OPEN, CLOSE, SEP, END_OF_MSG}
        self._scanner = MarkerScanner([OPEN, CLOSE, SEP, END_OF_MSG, *self._drop])
        self._stack = ["message", "think" if thinking else "response"]
        self._fresh = True  # nothing seen yet: a leading message/channel open is accepted
        self._header: str | None = None  # text after <|open|>/<|close|>, waiting for <|sep|>
        self._header_kind = OPEN
        self._stray = ""  # trailing whitespace between elements, resolved at the next element
        self._stray_live = False  # the current run between elements already gave content
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
        self._header = None  # an element cut off mid-header: markup, dropped
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

    @property
    def _ended(self) -> bool:
        """The message closed; what follows (only with ignore_eos) is plain content."""
        return not self._stack

    def _marker(self, marker: str) -> None:
        if marker in self._drop or self._ended:  # after the end no header is read: text streams on
            return
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
        # a stray <|sep|> is dropped

    def _abandon_header(self) -> None:
        """Text after <|open|>/<|close|> that is no header: the text stays, the marker goes."""
        text, self._header = self._header, None
        self._channel_text(text)

    def _complete_header(self) -> None:
        header, self._header = self._header, None
        pattern = _OPEN_HEADER if self._header_kind == OPEN else _CLOSE_HEADER
        if pattern.fullmatch(header) is None:
            self._channel_text(header)
            return
        tag = header.split(" ", 1)[0]
        attrs = {k: unescape_attr(v) for k, v in _ATTR.findall(header[len(tag):])}
        fits = self._open(tag, attrs) if self._header_kind == OPEN else self._close(tag)
        if not fits:  # an element that fits nowhere: its text, no markers
            self._channel_text(header)
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
        self._commit_call()

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
        elif top is None:
            self._content(text)
        else:
            self._stray_text(text)
        if text.strip():
            self._fresh = False

    def _stray_text(self, text: str) -> None:
        """Text between elements is content when the run between the two elements is more than
        whitespace: it goes out up to its last non-blank character at once; trailing whitespace
        waits for the run's end (a blank run is dropped)."""
        self._stray += text
        body = self._stray.rstrip()
        if body:
            self._content(body)
            self._stray = self._stray[len(body):]
            self._stray_live = True

    def _flush_stray(self) -> None:
        """The run of text between elements ends."""
        stray, self._stray = self._stray, ""
        if self._stray_live or stray.strip():
            self._content(stray)
        self._stray_live = False
