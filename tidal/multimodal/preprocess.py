"""The K2.5 / K3 image processor with Pillow, as Moonshot's and vLLM's code (vision.md §3).

RGB -> ``navit_resize`` (never upscaled; at most ``in_patch_limit`` patches and
``patch_limit_on_one_side`` patches per side; int() truncation) with PIL bicubic -> zero padding at
the bottom and right to a multiple of patch x merge (28) -> x/255, then (x - 0.5) / 0.5 (the pad
becomes -1) -> patches [h*w, 3, 14, 14] in raster order. One merged token per 2x2 patches.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from tidal.model.vision.config import VisionConfig

IMAGE_MEAN = 0.5
IMAGE_STD = 0.5


def navit_resize(height: int, width: int, c: VisionConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized height, width), (padded height, width)) in pixels for an image of that size."""
    p, side = c.patch_size, c.patch_limit_on_one_side
    patches = max(1, height // p) * max(1, width // p)
    scale = min(1.0, math.sqrt(c.in_patch_limit / patches), side * p / height, side * p / width)
    new_h = min(max(1, int(height * scale)), side * p)
    new_w = min(max(1, int(width * scale)), side * p)
    m = c.pad_multiple
    return (new_h, new_w), (-(-new_h // m) * m, -(-new_w // m) * m)


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: what the tower reads and what the prompt needs to know of it.
    ``hash`` identifies the pixels the tower sees (the encoder cache and prefix cache key)."""

    patches: torch.Tensor = field(repr=False)  # [h * w, 3, p, p] float32
    grid: tuple[int, int]  # (h, w) in patches
    size: tuple[int, int]  # (width, height) of the upload, as K3's prompt names it
    hash: str
    merge_size: int = 4

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1] // self.merge_size

    @property
    def nbytes(self) -> int:
        return self.patches.numel() * self.patches.element_size()


def preprocess_image(image: Image.Image, c: VisionConfig) -> ImageInput:
    width, height = image.size
    rgb = image.convert("RGB")
    (new_h, new_w), (pad_h, pad_w) = navit_resize(height, width, c)
    if (new_h, new_w) != (height, width):
        rgb = rgb.resize((new_w, new_h), Image.Resampling.BICUBIC)
    pixels = np.zeros((pad_h, pad_w, 3), dtype=np.float32)
    pixels[:new_h, :new_w] = np.asarray(rgb, dtype=np.float32) / 255.0
    pixels = (pixels - IMAGE_MEAN) / IMAGE_STD
    p = c.patch_size
    gh, gw = pad_h // p, pad_w // p
    patches = torch.from_numpy(pixels).view(gh, p, gw, p, 3).permute(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    patches = patches.contiguous()
    digest = hashlib.sha256(f"{gh}x{gw}:".encode() + patches.numpy().tobytes()).hexdigest()
    return ImageInput(patches, (gh, gw), (width, height), digest, c.merge_size)
