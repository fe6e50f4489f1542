"""A rendered prompt's image parts -> preprocessed images and their placeholder spans, or a 400
naming the problem (no vision tower, too many images, an image that cannot be read)."""

from __future__ import annotations

from typing import Any

from tidal.engine.request import ImageItem
from tidal.model.vision.config import VisionConfig
from tidal.multimodal import ImageError, ImageInput, ImageLimits, decode_image, preprocess_image
from tidal.multimodal.fetch import image_bytes
from tidal.serve.chat import RenderedPrompt
from tidal.serve.errors import bad_request

NO_IMAGES = "this model takes no images"


def load_images(parts: list[dict[str, Any]], vision: VisionConfig | None, limits: ImageLimits) -> list[ImageInput]:
    """Blocking (decode, maybe fetch, resize): run it on a worker thread."""
    if not parts:
        return []
    if vision is None:
        raise bad_request(NO_IMAGES, "messages")
    if len(parts) > limits.max_images:
        raise bad_request(f"the prompt has {len(parts)} images, more than the limit of {limits.max_images} "
                          "(--limit-mm-per-prompt)", "messages")
    out = []
    for i, part in enumerate(parts):
        where = f"image {i + 1} of {len(parts)}"
        try:
            out.append(preprocess_image(decode_image(image_bytes(part, limits, where), limits, where), vision))
        except ImageError as e:
            raise bad_request(str(e), "messages") from e
    return out


def encode_with_images(prompt: RenderedPrompt, tokenizer: Any, vision: VisionConfig | None,
                       limits: ImageLimits) -> tuple[list[int], list[ImageItem]]:
    """(token ids, the images at their placeholder offsets) of a rendered prompt."""
    images = load_images(prompt.images, vision, limits)
    ids, spans = prompt.encode(tokenizer, images)
    return ids, [ImageItem(span.offset, image) for span, image in zip(spans, images)]
