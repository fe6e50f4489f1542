"""``vision_config`` of a Kimi K2.5 / K3 checkpoint (MoonViT3d key names, vision.md §1, §5).

Absent switches take K2.5's values (LayerNorm, biases, bicubic, ``qkv_hidden_size`` = width);
K3's block turns them to RMSNorm, no biases, bilinear and a 1536-wide attention. Sizes have no
default: a missing one is an error naming it, and so is a value that contradicts another field or
the text model. Keys tidal does not read are logged, never silently taken as understood.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.config import ConfigError

log = logging.getLogger("tidal.config")

NORM_TYPES = ("layernorm", "rmsnorm")
INTERPOLATION_MODES = ("bicubic", "bilinear")
PROJECTOR_TYPES = ("patchmerger", "patchmergerv2")
ACTIVATIONS = ("gelu_pytorch_tanh",)
# K2.5's image processor limits (vision.md §3), used when no preprocessor config says otherwise.
DEFAULT_IN_PATCH_LIMIT = 16384
DEFAULT_PATCH_LIMIT_ON_ONE_SIDE = 512

# Keys that carry no math for images (video attention, implementation hints, identity).
_INFORMATIONAL = {"model_type", "video_attn_type", "_attn_implementation", "pos_emb_type", "torch_dtype",
                  "dtype", "transformers_version", "architectures", "projector_hidden_act", "merge_type"}


@dataclass(frozen=True)
class VisionConfig:
    """The MoonViT tower, the patch-merger projector and the image processor limits."""

    patch_size: int
    pos_emb_height: int
    pos_emb_width: int
    pos_emb_time: int
    interpolation_mode: str  # position-table resampling: "bicubic" (K2.5) or "bilinear" (K3)
    merge_kernel_size: tuple[int, int]
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    qkv_hidden_size: int  # width of q, k and v each (K3: 1536 = 12 heads x 128)
    norm_type: str
    attn_bias: bool
    linear_bias: bool
    patch_embed_bias: bool
    activation: str
    projector_type: str  # "patchmerger" (K2.5: pre_norm, biases) or "patchmergerv2" (K3: post_norm)
    mm_hidden_size: int
    text_hidden_size: int
    projector_ln_eps: float
    rope_theta: float = 10000.0
    in_patch_limit: int = DEFAULT_IN_PATCH_LIMIT  # patches per image before merging
    patch_limit_on_one_side: int = DEFAULT_PATCH_LIMIT_ON_ONE_SIDE

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_attention_heads

    @property
    def merge_size(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def pad_multiple(self) -> int:
        """Images are padded to a multiple of this many pixels per side (patch x merge kernel)."""
        return self.patch_size * self.merge_kernel_size[0]

    def to_dict(self) -> dict[str, Any]:
        """The ``vision_config`` block that :func:`parse_vision_config` reads back to an equal config."""
        return {
            "model_type": "moonvit3d", "patch_size": self.patch_size, "init_pos_emb_height": self.pos_emb_height,
            "init_pos_emb_width": self.pos_emb_width, "init_pos_emb_time": self.pos_emb_time,
            "pos_emb_interpolation_mode": self.interpolation_mode, "merge_kernel_size": list(self.merge_kernel_size),
            "merge_type": "sd2_tpool", "vt_hidden_size": self.hidden_size,
            "vt_intermediate_size": self.intermediate_size, "vt_num_hidden_layers": self.num_hidden_layers,
            "vt_num_attention_heads": self.num_attention_heads, "qkv_hidden_size": self.qkv_hidden_size,
            "norm_type": self.norm_type, "attn_bias": self.attn_bias, "linear_bias": self.linear_bias,
            "patch_embed_proj_bias": self.patch_embed_bias, "activation": self.activation,
            "mm_projector_type": self.projector_type, "mm_hidden_size": self.mm_hidden_size,
            "text_hidden_size": self.text_hidden_size, "projector_ln_eps": self.projector_ln_eps,
            "rope_theta": self.rope_theta, "in_patch_limit": self.in_patch_limit,
            "patch_limit_on_one_side": self.patch_limit_on_one_side,
        }


_KNOWN = {
    "patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time", "pos_emb_interpolation_mode",
    "merge_kernel_size", "vt_hidden_size", "vt_intermediate_size", "vt_num_hidden_layers", "vt_num_attention_heads",
    "qkv_hidden_size", "norm_type", "attn_bias", "linear_bias", "patch_embed_proj_bias", "activation",
    "hidden_act", "mm_projector_type", "mm_hidden_size", "text_hidden_size", "projector_ln_eps", "rope_theta",
    "in_patch_limit", "patch_limit_on_one_side",
}


def parse_vision_config(raw: Any, text_hidden_size: int, model_dir: Path | None = None) -> VisionConfig:
    """A ``vision_config`` block -> :class:`VisionConfig`; ``text_hidden_size`` is the language
    model's width, which the projector's output must equal."""
    p = "vision_config."
    if not isinstance(raw, dict):
        raise ConfigError(f"config field 'vision_config' must be an object, not {type(raw).__name__}")

    def get(name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = raw.get(name)
        if value is None:
            if default is None:
                raise ConfigError(f"config field '{p}{name}' is missing")
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(f"config field '{p}{name}' has type {type(value).__name__}, expected {kind.__name__}")
        return value

    def positive(name: str, default: int | None = None) -> int:
        value = get(name, int, default)
        if value <= 0:
            raise ConfigError(f"config field '{p}{name}' must be > 0, got {value}")
        return value

    def choice(name: str, options: tuple[str, ...], default: str) -> str:
        value = get(name, str, default)
        if value not in options:
            raise ConfigError(f"config field '{p}{name}' is {value!r}; supported: {', '.join(options)}")
        return value

    unknown = sorted(set(raw) - _KNOWN - _INFORMATIONAL)
    if unknown:
        log.info("vision_config: fields not read by tidal (no effect on images): %s", ", ".join(unknown))
    hidden = positive("vt_hidden_size")
    heads = positive("vt_num_attention_heads")
    qkv = positive("qkv_hidden_size", hidden)
    kernel = raw.get("merge_kernel_size", [2, 2])
    if not (isinstance(kernel, (list, tuple)) and len(kernel) == 2 and all(isinstance(k, int) and k > 0 for k in kernel)):
        raise ConfigError(f"config field '{p}merge_kernel_size' must be two positive integers, got {kernel!r}")
    activation = raw.get("activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if activation not in ACTIVATIONS:
        raise ConfigError(f"config field '{p}activation' is {activation!r}; supported: {', '.join(ACTIVATIONS)}")
    cfg = VisionConfig(
        patch_size=positive("patch_size", 14),
        pos_emb_height=positive("init_pos_emb_height", 64),
        pos_emb_width=positive("init_pos_emb_width", 64),
        pos_emb_time=positive("init_pos_emb_time", 4),
        interpolation_mode=choice("pos_emb_interpolation_mode", INTERPOLATION_MODES, "bicubic"),
        merge_kernel_size=(kernel[0], kernel[1]),
        hidden_size=hidden,
        intermediate_size=positive("vt_intermediate_size"),
        num_hidden_layers=positive("vt_num_hidden_layers"),
        num_attention_heads=heads,
        qkv_hidden_size=qkv,
        norm_type=choice("norm_type", NORM_TYPES, "layernorm"),
        attn_bias=get("attn_bias", bool, True),
        linear_bias=get("linear_bias", bool, True),
        patch_embed_bias=get("patch_embed_proj_bias", bool, True),
        activation=activation,
        projector_type=choice("mm_projector_type", PROJECTOR_TYPES, "patchmerger"),
        mm_hidden_size=positive("mm_hidden_size", hidden),
        text_hidden_size=positive("text_hidden_size", text_hidden_size),
        projector_ln_eps=get("projector_ln_eps", float, 1e-5),
        rope_theta=get("rope_theta", float, 10000.0),
        in_patch_limit=positive("in_patch_limit", DEFAULT_IN_PATCH_LIMIT),
        patch_limit_on_one_side=positive("patch_limit_on_one_side", DEFAULT_PATCH_LIMIT_ON_ONE_SIDE),
    )
    if model_dir is not None:
        cfg = _with_processor_limits(cfg, model_dir)
    _check(cfg, text_hidden_size)
    return cfg


def _check(c: VisionConfig, text_hidden_size: int) -> None:
    p = "vision_config."
    if c.qkv_hidden_size % c.num_attention_heads:
        raise ConfigError(f"config fields '{p}qkv_hidden_size' ({c.qkv_hidden_size}) and 'vt_num_attention_heads' "
                          f"({c.num_attention_heads}) contradict: the heads do not divide the width")
    if c.head_dim % 4:
        raise ConfigError(f"config fields '{p}qkv_hidden_size'/'vt_num_attention_heads' give head_dim {c.head_dim}, "
                          "not a multiple of 4 as the 2-D rotary embedding needs")
    if c.mm_hidden_size != c.hidden_size:
        raise ConfigError(f"config fields '{p}mm_hidden_size' ({c.mm_hidden_size}) and 'vt_hidden_size' "
                          f"({c.hidden_size}) contradict: the projector reads the tower's output")
    if c.text_hidden_size != text_hidden_size:
        raise ConfigError(f"config field '{p}text_hidden_size' ({c.text_hidden_size}) contradicts the text model's "
                          f"hidden_size ({text_hidden_size})")
    if c.projector_type == "patchmergerv2" and c.norm_type != "rmsnorm":
        raise ConfigError(f"config fields '{p}mm_projector_type' (patchmergerv2) and 'norm_type' ({c.norm_type}) "
                          "contradict: the K3 tower and projector use RMSNorm")
    if c.patch_limit_on_one_side * c.patch_limit_on_one_side < 1 or c.in_patch_limit < c.merge_size:
        raise ConfigError(f"config field '{p}in_patch_limit' ({c.in_patch_limit}) is below one merged token")


def _with_processor_limits(c: VisionConfig, model_dir: Path) -> VisionConfig:
    """Patch limits from the checkpoint's preprocessor_config.json when it has them (Moonshot's
    ``media_proc_cfg`` names or transformers' ``max_patches`` / ``size.max_height``)."""
    import dataclasses

    path = model_dir / "preprocessor_config.json"
    if not path.is_file():
        return c
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    data = data.get("media_proc_cfg", data)
    limit = data.get("in_patch_limit", data.get("max_patches"))
    side = data.get("patch_limit_on_one_side")
    if side is None and isinstance(data.get("size"), dict):
        side = data["size"].get("max_height")
    changes = {}
    for name, value in (("in_patch_limit", limit), ("patch_limit_on_one_side", side)):
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{path}: field '{name}' must be a positive integer, got {value!r}")
            changes[name] = value
    return dataclasses.replace(c, **changes)
