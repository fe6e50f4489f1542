"""Incremental detokenisation for streaming: token ids in, text deltas out.

Works on token bytes, not on decoded strings, so a character split across byte-level tokens
(emoji, CJK) is held back until its last byte arrives and never comes out as U+FFFD. Special
tokens decode to their names: the reply parsers need the markers.
"""

from __future__ import annotations

import codecs
from typing import Protocol


class TokenBytes(Protocol):
    special_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...


class Detokenizer:
    """Text of one generated sequence, one token at a time. ``drop_prefix``: bytes the sequence is
    known to start with that are not part of its text (token healing regenerates the prompt's
    last token; the constraint that forces them is :class:`tidal.engine.grammar.PrefixConstraint`)."""

    def __init__(self, tokenizer: TokenBytes, *, skip_special_tokens: bool = False, drop_prefix: bytes = b"") -> None:
        self.tokenizer = tokenizer
        self.skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._drop = drop_prefix
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (maybe empty, when it ends inside a
        multi-byte character)."""
        if token_id in self.skip:
            return ""
        raw = self.tokenizer.token_bytes(token_id)
        if self._drop:
            n = min(len(self._drop), len(raw))
            raw, self._drop = raw[n:], self._drop[n:]
        delta = self._utf8.decode(raw)
        self.text += delta
        return delta

    def add_many(self, token_ids: list[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """End of the sequence: bytes of an unfinished character come out as U+FFFD."""
        delta = self._utf8.decode(b"", final=True)
        self.text += delta
        return delta

    @property
    def pending_bytes(self) -> int:
        """How many bytes are held back waiting for the rest of a character."""
        return len(self._utf8.getstate()[0])
