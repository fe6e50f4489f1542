"""Splits streamed text into plain text and markers, holding back any tail that could still
become a marker: markers span several tokens, so ``<|clo`` may be the start of ``<|close|>``."""

from __future__ import annotations

import re
from collections.abc import Iterable

Piece = tuple[str, bool]  # (text, is_marker)


class MarkerScanner:
    def __init__(self, markers: Iterable[str]) -> None:
        markers = sorted(set(markers), key=len, reverse=True)  # longest first wins a tie
        self._re = re.compile("|".join(re.escape(m) for m in markers))
        self._prefixes = {m[:k] for m in markers for k in range(1, len(m))}
        self._longest = max(len(m) for m in markers)
        self._buf = ""

    def feed(self, text: str) -> list[Piece]:
        buf = self._buf + text
        out: list[Piece] = []
        pos = 0
        for m in self._re.finditer(buf):
            if m.start() > pos:
                out.append((buf[pos : m.start()], False))
            out.append((m.group(), True))
            pos = m.end()
        keep = self._partial_tail(buf, pos)
        if len(buf) - keep > pos:
            out.append((buf[pos : len(buf) - keep], False))
        self._buf = buf[len(buf) - keep :]
        return out

    def flush(self) -> str:
        """The held-back tail (at the end of the stream it is plain text)."""
        rest, self._buf = self._buf, ""
        return rest

    def _partial_tail(self, buf: str, start: int) -> int:
        """Length of the longest tail of ``buf[start:]`` that is a proper prefix of a marker."""
        for k in range(min(self._longest - 1, len(buf) - start), 0, -1):
            if buf[len(buf) - k :] in self._prefixes:
                return k
        return 0
