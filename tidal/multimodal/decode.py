"""Image bytes -> a Pillow image, within the server's limits; every refusal names the problem."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_LIMIT_IMAGES_PER_PROMPT = 16


class ImageError(ValueError):
    """An image the server refuses (a 400): corrupt, unsupported, too large, too many, unreachable."""


@dataclass(frozen=True)
class ImageLimits:
    """``--limit-mm-per-prompt`` (images), ``--max-image-pixels``, ``--max-image-bytes`` and the
    URL fetch switches (``--allow-image-url-fetch``, ``--image-fetch-timeout``)."""

    max_images: int = DEFAULT_LIMIT_IMAGES_PER_PROMPT
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    allow_url_fetch: bool = False
    fetch_timeout: float = 5.0


def decode_image(data: bytes, limits: ImageLimits, where: str = "image") -> Image.Image:
    """Decode and fully load ``data``; the pixel count is checked from the header, before decoding."""
    if not data:
        raise ImageError(f"{where}: the image data is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: the image is {len(data)} bytes, more than the limit of {limits.max_bytes} "
                         "(--max-image-bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        raise ImageError(f"{where}: the data is not an image in a supported format "
                         f"({', '.join(SUPPORTED_FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning, OSError, ValueError) as e:
        raise ImageError(f"{where}: the image cannot be read ({e})") from None
    if image.format not in SUPPORTED_FORMATS:
        raise ImageError(f"{where}: image format {image.format} is not supported; supported: "
                         f"{', '.join(SUPPORTED_FORMATS)}")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(f"{where}: the image is {width}x{height} = {width * height} pixels, more than the limit "
                         f"of {limits.max_pixels} (--max-image-pixels)")
    if width < 1 or height < 1:
        raise ImageError(f"{where}: the image has no pixels ({width}x{height})")
    try:
        image.load()
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for truncated or corrupt data
        raise ImageError(f"{where}: the {image.format} data is corrupt or truncated ({e})") from None
    return image
