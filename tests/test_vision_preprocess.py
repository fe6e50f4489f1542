"""The image processor against a reference written here from vision.md §3 (pixel values, grid,
token count), on odd, tiny and huge images; the decoder's refusals."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from tidal import presets
from tidal.multimodal import ImageError, ImageLimits, decode_image, navit_resize, preprocess_image

CFG = presets.preset("kimi-k3").vision  # patch 14, merge 2x2, 16384 patches, 512 per side


def reference(image: Image.Image):
    """vision.md §3, step by step."""
    W, H = image.size
    scale = min(1.0, math.sqrt(16384 / (max(1, H // 14) * max(1, W // 14))), 512 * 14 / H, 512 * 14 / W)
    h, w = max(1, int(H * scale)), max(1, int(W * scale))
    h, w = min(h, 512 * 14), min(w, 512 * 14)
    img = image.convert("RGB")
    if (h, w) != (H, W):
        img = img.resize((w, h), Image.BICUBIC)
    ph, pw = h + (28 - h % 28) % 28, w + (28 - w % 28) % 28
    canvas = np.zeros((ph, pw, 3), dtype=np.float64)
    canvas[:h, :w] = np.asarray(img, dtype=np.float64) / 255
    canvas = (canvas - 0.5) / 0.5
    patches = []
    for r in range(ph // 14):
        for c in range(pw // 14):
            patches.append(canvas[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14].transpose(2, 0, 1))
    return np.stack(patches), (ph // 14, pw // 14), (ph // 28) * (pw // 28)


def noise(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


@pytest.mark.parametrize("w, h, mode", [
    (1, 1, "RGB"), (3, 200, "RGB"), (13, 13, "L"), (37, 91, "RGBA"), (448, 448, "RGB"), (641, 479, "RGB"),
    (1024, 1024, "RGB"), (7300, 40, "RGB"), (2500, 2600, "RGB"),
])
def test_preprocess_matches_spec_reference(w, h, mode):
    image = noise(w, h, w * 7 + h, mode)
    ours = preprocess_image(image, CFG)
    ref_patches, ref_grid, ref_tokens = reference(image)
    assert ours.grid == ref_grid and ours.num_tokens == ref_tokens and ours.size == (w, h)
    assert ours.patches.shape == (ref_grid[0] * ref_grid[1], 3, 14, 14)
    np.testing.assert_allclose(ours.patches.numpy(), ref_patches, atol=1e-6)


def test_navit_rules():
    assert navit_resize(448, 448, CFG) == ((448, 448), (448, 448))  # 32x32 patches, 256 tokens
    assert navit_resize(1, 1, CFG) == ((1, 1), (28, 28))
    (h, w), (ph, pw) = navit_resize(2600, 2500, CFG)  # over 16384 patches: scaled down, never up
    assert (h // 14) * (w // 14) <= 16384 and h < 2600 and ph % 28 == pw % 28 == 0
    (h, w), _ = navit_resize(40, 7300, CFG)  # 521 patches wide: capped at 512 per side
    assert w == 7168


def test_same_pixels_same_hash_different_pixels_different_hash():
    a, b = noise(60, 50, 1), noise(60, 50, 2)
    png, jpeg_free = io.BytesIO(), io.BytesIO()
    a.save(png, "PNG")
    a.save(jpeg_free, "BMP")
    limits = ImageLimits()
    from_png = preprocess_image(decode_image(png.getvalue(), limits), CFG)
    from_bmp = preprocess_image(decode_image(jpeg_free.getvalue(), limits), CFG)
    assert from_png.hash == from_bmp.hash  # the key is what the tower sees, not the file's bytes
    assert preprocess_image(b, CFG).hash != from_png.hash


def encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def test_decoder_refusals_name_the_problem():
    limits = ImageLimits(max_pixels=10_000, max_bytes=200_000)
    png = encoded(noise(50, 40, 3), "PNG")
    assert decode_image(png, limits).size == (50, 40)
    with pytest.raises(ImageError, match="the image data is empty"):
        decode_image(b"", limits)
    with pytest.raises(ImageError, match="not an image in a supported format"):
        decode_image(b"hello, this is text", limits)
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode_image(png[: len(png) // 2], limits)
    with pytest.raises(ImageError, match="200x100 = 20000 pixels, more than the limit of 10000"):
        decode_image(encoded(noise(200, 100, 4), "PNG"), limits)
    with pytest.raises(ImageError, match="more than the limit of 200000 \\(--max-image-bytes\\)"):
        decode_image(b"\x89PNG" + bytes(300_000), limits)
    with pytest.raises(ImageError, match="image format TIFF is not supported"):
        decode_image(encoded(noise(20, 20, 5), "TIFF"), limits)
