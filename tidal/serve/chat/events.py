"""What the reply parsers produce, and the base both formats share.

A parser takes text deltas of the model's reply and returns events: reasoning text, content
text, the start of a tool call (index, id, name) and fragments of its JSON arguments. Fed the
whole reply at once or in any pieces, the events add up to the same ``ParsedReply``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("tidal.serve")


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0-based, in the order of the reply
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str  # a fragment of the JSON arguments text


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallDelta


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ParsedReply:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def apply(self, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                self.reasoning += ev.text
            elif isinstance(ev, ContentDelta):
                self.content += ev.text
            elif isinstance(ev, ToolCallStart):
                self.tool_calls.append(ToolCall(ev.id, ev.name))
            else:
                self.tool_calls[ev.index].arguments += ev.arguments

    @property
    def finish_reason(self) -> str:
        """"tool_calls" when the reply called tools, else "stop" (the caller knows "length")."""
        return "tool_calls" if self.tool_calls else "stop"


def random_call_id(index: int) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class DroppedCall:
    """A tool call the reply left unfinished (cut by max_tokens): never sent to the client."""

    name: str
    partial_arguments: str


class ReplyParser:
    """Base of the streaming parsers: collects events (adjacent text deltas of one kind merged)
    and keeps the running ``result``. A tool call's events are held until the call closes, so a
    client only ever sees complete calls with valid JSON arguments; one still open when the reply
    ends is dropped (``dropped_call``)."""

    def __init__(self, make_id: Callable[[int], str] | None = None) -> None:
        self.make_id = make_id or random_call_id
        self.result = ParsedReply()
        self._events: list[Event] = []
        self._open_call: list[Event] | None = None  # events of the call being written
        self.dropped_call: DroppedCall | None = None
        self.num_calls = 0

    # --- to implement -------------------------------------------------------------------------
    def _feed(self, text: str) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now lands in the reasoning channel (to count reasoning tokens)."""
        raise NotImplementedError

    # --- public ---------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        """Events for one more piece of the reply (markers still unresolved are held back)."""
        self._feed(text)
        return self._drain()

    def finish(self) -> list[Event]:
        """End of the reply: whatever was held back is resolved, as text where it is no marker."""
        self._finish()
        if self._open_call is not None:
            start, *args = self._open_call
            self.dropped_call = DroppedCall(start.name, "".join(a.arguments for a in args))
            self._open_call = None
            logger.warning("the reply ended inside a call of %r: the call is dropped (partial arguments %r)",
                           start.name, self.dropped_call.partial_arguments[:200])
        return self._drain()

    def parse_full(self, text: str) -> ParsedReply:
        """The whole reply at once (the non-streaming API)."""
        self.feed(text)
        self.finish()
        return self.result

    # --- helpers for subclasses ---------------------------------------------------------------
    def _emit(self, ev: Event) -> None:
        if self._open_call is not None and isinstance(ev, (ToolCallStart, ToolCallDelta)):
            self._open_call.append(ev)
            return
        last = self._events[-1] if self._events else None
        if isinstance(ev, (ReasoningDelta, ContentDelta)):
            if not ev.text:
                return
            if type(last) is type(ev):
                self._events[-1] = type(ev)(last.text + ev.text)
                return
        elif isinstance(ev, ToolCallDelta):
            if not ev.arguments:
                return
            if isinstance(last, ToolCallDelta) and last.index == ev.index:
                self._events[-1] = ToolCallDelta(ev.index, last.arguments + ev.arguments)
                return
        self._events.append(ev)

    def _reasoning(self, text: str) -> None:
        self._emit(ReasoningDelta(text))

    def _content(self, text: str) -> None:
        self._emit(ContentDelta(text))

    def _start_call(self, name: str, call_id: str | None = None) -> int:
        index = self.num_calls
        self.num_calls += 1
        self._open_call = [ToolCallStart(index, call_id or self.make_id(index), name)]
        return index

    def _commit_call(self) -> None:
        """The open call closed: its start and arguments go out (as one arguments delta)."""
        if self._open_call is None:
            return
        start, *args = self._open_call
        self._open_call = None
        self._emit(start)
        self._emit(ToolCallDelta(start.index, "".join(a.arguments for a in args)))

    def _arguments(self, index: int, text: str) -> None:
        self._emit(ToolCallDelta(index, text))

    def _drain(self) -> list[Event]:
        events, self._events = self._events, []
        self.result.apply(events)
        return events
