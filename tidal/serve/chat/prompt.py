"""A rendered prompt: text segments that are either special markers or ordinary text.

Keeping the two apart is what stops a user who types ``<|open|>`` from producing the special id:
markers become special ids, everything else is encoded as plain text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class SegmentTokenizer(Protocol):
    special_tokens: dict[str, int]

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]: ...


@dataclass
class RenderOptions:
    """Everything about a chat request besides its messages that shapes the prompt. ``thinking``
    is an effort: off/low/high/max (default max); any other value is a ValueError."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    thinking: str | bool | None = None
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class Segment:
    text: str
    special: bool = False


@dataclass
class RenderedPrompt:
    """``segments`` in order; ``thinking`` says whether the reply starts in the reasoning channel
    (the generation prompt opened it), which its parser needs to know."""

    segments: list[Segment] = field(default_factory=list)
    thinking: bool = False

    def add_special(self, marker: str) -> None:
        self.segments.append(Segment(marker, True))

    def add_text(self, text: str) -> None:
        """Append ordinary text, merged into the previous text segment (encoded as one run, as the
        whole-string tokenisation between two markers would be)."""
        if not text:
            return
        if self.segments and not self.segments[-1].special:
            self.segments[-1] = Segment(self.segments[-1].text + text)
        else:
            self.segments.append(Segment(text))

    @property
    def text(self) -> str:
        """The prompt as one string, markers written as their names."""
        return "".join(s.text for s in self.segments)

    def token_ids(self, tokenizer: SegmentTokenizer) -> list[int]:
        """Markers -> their special ids; text -> ordinary tokens even where it spells a marker."""
        ids: list[int] = []
        for seg in self.segments:
            if seg.special:
                if seg.text not in tokenizer.special_tokens:
                    raise ValueError(f"the tokenizer has no special token {seg.text!r}")
                ids.append(tokenizer.special_tokens[seg.text])
            else:
                ids += tokenizer.encode(seg.text, allow_special=False)
        return ids
