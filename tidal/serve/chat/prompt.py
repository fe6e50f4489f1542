"""A rendered prompt: text segments that are either special markers or ordinary text.

Keeping the two apart is what stops a user who types ``<|open|>`` from producing the special id:
markers become special ids, everything else is encoded as plain text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# Media tokens (vision.md §4): an image becomes BEGIN "image[ WxH]" CONTENT PAD x N END, one PAD
# per merged patch, each replaced by that patch's embedding.
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"


class SegmentTokenizer(Protocol):
    special_tokens: dict[str, int]

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]: ...


@dataclass
class RenderOptions:
    """Everything about a chat request besides its messages that shapes the prompt. ``thinking``
    is an effort: off/low/high/max (default max); any other value is a ValueError.
    ``continue_final_message`` (vLLM's): the last message, the assistant's, is left open so the
    reply continues its text (instead of a generation prompt opening a new one)."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    thinking: str | bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass(frozen=True)
class Segment:
    text: str
    special: bool = False
    image: dict[str, Any] | None = field(default=None, compare=False)  # the content part of an image


class ImageLike(Protocol):
    size: tuple[int, int]  # (width, height) of the upload

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's placeholder tokens sit in the prompt: ``offset .. offset + length - 1``."""

    offset: int
    length: int


@dataclass
class RenderedPrompt:
    """``segments`` in order; ``thinking`` says whether the reply starts in the reasoning channel
    (the generation prompt opened it), which its parser needs to know."""

    segments: list[Segment] = field(default_factory=list)
    thinking: bool = False
    may_think: bool = False  # K2: the reply may open with <think> (thinking on, <think> a special token)
    image_size_in_header: bool = False  # K3 writes "image {W}x{H}", K2.5 "image"
    # Set by the server once the images are loaded: each image at its placeholder offset
    # (tidal.engine.request.ImageItem), in prompt order.
    image_items: list[Any] = field(default_factory=list)

    def add_image(self, part: dict[str, Any], placeholder: str) -> None:
        """An image content part; ``placeholder`` is how the prompt's text shows it."""
        self.segments.append(Segment(placeholder, image=part))

    def add_content(self, parts: str | list[Any], placeholder: str) -> None:
        """Text runs and image parts (``messages.content_parts``) in order."""
        for part in [parts] if isinstance(parts, str) else parts:
            if isinstance(part, str):
                self.add_text(part)
            else:
                self.add_image(part, placeholder)

    @property
    def images(self) -> list[dict[str, Any]]:
        """The image content parts, in prompt order."""
        return [s.image for s in self.segments if s.image is not None]

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

    def token_ids(self, tokenizer: SegmentTokenizer, images: list[ImageLike] | None = None) -> list[int]:
        """Markers -> their special ids; text -> ordinary tokens even where it spells a marker."""
        return self.encode(tokenizer, images)[0]

    def encode(self, tokenizer: SegmentTokenizer, images: list[ImageLike] | None = None
               ) -> tuple[list[int], list[ImageSpan]]:
        """(token ids, the span of each image's placeholder tokens). ``images`` are the
        preprocessed :attr:`images`, in order (their size and token count shape the prompt)."""
        ids: list[int] = []
        spans: list[ImageSpan] = []
        n_images = len(self.images)
        if n_images and (images is None or len(images) != n_images):
            raise ValueError(f"the prompt has {n_images} image(s) but {len(images or [])} were given")

        def special(name: str) -> int:
            if name not in tokenizer.special_tokens:
                raise ValueError(f"the tokenizer has no special token {name!r}")
            return tokenizer.special_tokens[name]

        for seg in self.segments:
            if seg.image is not None:
                image = images[len(spans)]  # type: ignore[index]
                header = f"image {image.size[0]}x{image.size[1]}" if self.image_size_in_header else "image"
                ids.append(special(MEDIA_BEGIN))
                ids += tokenizer.encode(header, allow_special=False)
                ids.append(special(MEDIA_CONTENT))
                spans.append(ImageSpan(len(ids), image.num_tokens))
                ids += [special(MEDIA_PAD)] * image.num_tokens
                ids.append(special(MEDIA_END))
            elif seg.special:
                if seg.text not in tokenizer.special_tokens:
                    raise ValueError(f"the tokenizer has no special token {seg.text!r}")
                ids.append(tokenizer.special_tokens[seg.text])
            else:
                ids += tokenizer.encode(seg.text, allow_special=False)
        return ids, spans
