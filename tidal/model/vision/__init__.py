"""The Kimi K2.5 / K3 vision model (MoonViT tower + patch-merger projector) and its image inputs."""

from tidal.model.vision.config import VisionConfig, parse_vision_config
from tidal.model.vision.tower import KimiVisionModel, MoonViT, PatchMergerProjector

__all__ = ["KimiVisionModel", "MoonViT", "PatchMergerProjector", "VisionConfig", "parse_vision_config"]
