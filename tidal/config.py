"""Model configuration parsed from a Hugging Face ``config.json`` (Kimi-K3 and Kimi Linear).

Only fields that change the math are kept. Layer lists in ``config.json`` are 1-based; everything
here is 0-based.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tidal.model.vision.config import VisionConfig


class ConfigError(ValueError):
    """A config.json that tidal cannot run; the message names the field."""


SUPPORTED_MODEL_TYPES = ("kimi_k3", "kimi_linear")
SUPPORTED_ACTIVATIONS = ("silu", "situ")
EXPERT_FORMATS = ("dense", "mxfp4-pack-quantized")
A_LOG_LAYOUTS = ("head", "channel")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class ModelConfig:
    """Every architecture field of a Kimi-K3 / Kimi Linear text model (spec §1–§4)."""

    model_type: str  # "kimi_k3" or "kimi_linear" (the outer type)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # KDA
    kda_layers: tuple[int, ...]  # 0-based
    mla_layers: tuple[int, ...]  # 0-based
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_kernel: int
    kda_full_rank_gate: bool  # K3: g_proj hidden->P; Kimi Linear: g_a_proj/g_b_proj
    kda_gate_lower_bound: float | None  # K3: -5.0 (sigmoid gate); None: softplus gate
    kda_a_log_layout: str  # "head": A_log[h] (first H values, vLLM); "channel": A_log[d], d < head_dim
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # MLP / MoE
    hidden_act: str
    situ_beta: float
    situ_linear_beta: float
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    routed_expert_hidden_size: int | None  # K3 latent MoE width; None: experts at hidden_size
    latent_moe_use_norm: bool
    expert_format: str  # routed experts on disk: "dense" or "mxfp4-pack-quantized"
    # Block Attention Residuals
    attn_res_block_size: int | None
    # tokens
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    torch_dtype: str = "bfloat16"
    # K2.5/K3 vision: the MoonViT tower + projector (None: a text-only model) and the id of the
    # token whose embedding each merged image patch replaces (<|media_pad|>).
    vision: "VisionConfig | None" = None
    media_placeholder_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def kda_proj_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per MLA layer: the normalised latent c and k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_hidden_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def is_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def num_attn_res_blocks(self) -> int:
        if not self.attn_res_block_size:
            return 0
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    @property
    def kda_conv_state_shape(self) -> tuple[int, int]:
        """Per request per KDA layer: the last W-1 pre-conv q|k|v inputs, channels last (model dtype)."""
        return (self.kda_conv_kernel - 1, 3 * self.kda_proj_size)

    @property
    def kda_recurrent_state_shape(self) -> tuple[int, int, int]:
        """Per request per KDA layer: S [H, K, V], always float32."""
        return (self.kda_num_heads, self.kda_head_dim, self.kda_head_dim)

    def is_kda_layer(self, layer: int) -> bool:
        return layer in self._kda_index

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def kda_index(self, layer: int) -> int:
        """Position of a KDA layer among the KDA layers (its row in the state pool)."""
        return self._kda_index[layer]

    def mla_index(self, layer: int) -> int:
        """Position of an MLA layer among the MLA layers (its row in the KV pool)."""
        return self._mla_index[layer]

    @property
    def _kda_index(self) -> dict[int, int]:
        return {layer: i for i, layer in enumerate(self.kda_layers)}

    @property
    def _mla_index(self) -> dict[int, int]:
        return {layer: i for i, layer in enumerate(self.mla_layers)}

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return _parse(data, path.parent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return _parse(data)

    def to_dict(self) -> dict[str, Any]:
        """The HF config.json that :meth:`from_dict` reads back to an equal config."""
        text: dict[str, Any] = {
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.kda_conv_kernel,
            },
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "hidden_act": self.hidden_act,
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.model_type == "kimi_k3":
            lac = text["linear_attn_config"]
            lac["use_full_rank_gate"] = self.kda_full_rank_gate
            if self.kda_gate_lower_bound is not None:
                lac["gate_lower_bound"] = self.kda_gate_lower_bound
            text["mla_use_output_gate"] = self.mla_use_output_gate
            text["activation_situ_beta"] = self.situ_beta
            text["activation_situ_linear_beta"] = self.situ_linear_beta
            if self.routed_expert_hidden_size is not None:
                text["routed_expert_hidden_size"] = self.routed_expert_hidden_size
                text["latent_moe_use_norm"] = self.latent_moe_use_norm
            if self.attn_res_block_size:
                text["attn_res_block_size"] = self.attn_res_block_size
            if self.expert_format != "dense":
                text["quantization_config"] = {
                    "quant_method": "compressed-tensors",
                    "format": self.expert_format,
                }
            if self.kda_a_log_layout != "head":
                lac["a_log_layout"] = self.kda_a_log_layout
            out = {
                "architectures": ["KimiK3ForConditionalGeneration"],
                "model_type": "kimi_k3",
                "bos_token_id": self.bos_token_id,
                "eos_token_id": text["eos_token_id"],
                "pad_token_id": self.pad_token_id,
                "tie_word_embeddings": self.tie_word_embeddings,
                "torch_dtype": self.torch_dtype,
                "text_config": text,
            }
            if self.media_placeholder_token_id is not None:
                out["media_placeholder_token_id"] = self.media_placeholder_token_id
            if self.vision is not None:
                out["vision_config"] = self.vision.to_dict()
            return out
        text["architectures"] = ["KimiLinearForCausalLM"]
        if self.kda_gate_lower_bound is not None:
            text["linear_attn_config"]["gate_lower_bound"] = self.kda_gate_lower_bound
        return text

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with fields changed, re-validated through the same parser."""
        import dataclasses

        return _validate(dataclasses.replace(self, **changes))


# ---- parsing -----------------------------------------------------------------------------------

_MISSING = object()


class _Fields:
    """Reads fields from one dict and names the dotted path of anything missing or wrong."""

    def __init__(self, data: dict[str, Any], prefix: str) -> None:
        self.data, self.prefix = data, prefix

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
        value = self.data.get(name, _MISSING)
        if value is _MISSING or (value is None and default is not _MISSING and default is not None):
            if default is _MISSING:
                raise ConfigError(f"config field '{self.prefix}{name}' is missing")
            return default
        if value is None and default is None:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(
                f"config field '{self.prefix}{name}' has type {type(value).__name__}, expected {kind}"
            )
        return value

    def positive(self, name: str, default: Any = _MISSING) -> int:
        value = self.get(name, int, default)
        if value is not None and value <= 0:
            raise ConfigError(f"config field '{self.prefix}{name}' must be > 0, got {value}")
        return value


def _parse(data: dict[str, Any], model_dir: Path | None = None) -> ModelConfig:
    if not isinstance(data, dict):
        raise ConfigError("config.json must hold a JSON object")
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"config field 'model_type' is {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    outer = data
    prefix = ""
    if model_type == "kimi_k3":
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config field 'text_config' is missing (kimi_k3 keeps the language model there)")
        prefix = "text_config."
    else:
        text = data
    f = _Fields(text, prefix)
    lac_raw = f.get("linear_attn_config", dict)
    lac = _Fields(lac_raw, prefix + "linear_attn_config.")

    n_layers = f.positive("num_hidden_layers")
    kda_1 = lac.get("kda_layers", list)
    mla_1 = lac.get("full_attn_layers", list)
    for name, lst in (("kda_layers", kda_1), ("full_attn_layers", mla_1)):
        for i in lst:
            if not isinstance(i, int) or not 1 <= i <= n_layers:
                raise ConfigError(
                    f"config field '{prefix}linear_attn_config.{name}' has {i!r}, outside 1..{n_layers}"
                )
    overlap = sorted(set(kda_1) & set(mla_1))
    if overlap:
        raise ConfigError(
            f"config fields '{prefix}linear_attn_config.kda_layers' and 'full_attn_layers' both list layers {overlap}"
        )
    missing = sorted(set(range(1, n_layers + 1)) - set(kda_1) - set(mla_1))
    if missing:
        raise ConfigError(
            f"config fields '{prefix}linear_attn_config.kda_layers'/'full_attn_layers' do not cover layers {missing} "
            f"of num_hidden_layers={n_layers}"
        )

    if text.get("mla_use_nope", True) is not True:
        raise ConfigError(f"config field '{prefix}mla_use_nope' is false: rotary MLA is not supported (Kimi MLA is NoPE)")
    router_act = text.get("moe_router_activation_func", "sigmoid")
    if router_act != "sigmoid":
        raise ConfigError(f"config field '{prefix}moe_router_activation_func' is {router_act!r}; only 'sigmoid' is supported")
    n_heads = f.positive("num_attention_heads")
    n_kv = text.get("num_key_value_heads")
    if n_kv is not None and n_kv != n_heads:
        raise ConfigError(
            f"config field '{prefix}num_key_value_heads' ({n_kv}) must equal num_attention_heads ({n_heads}) for MLA"
        )

    quant = text.get("quantization_config") or outer.get("quantization_config")
    expert_format = "dense"
    if quant is not None:
        if not isinstance(quant, dict):
            raise ConfigError("config field 'quantization_config' must be an object")
        fmt = quant.get("format")
        method = quant.get("quant_method")
        if method == "compressed-tensors" and fmt == "mxfp4-pack-quantized":
            expert_format = fmt
        else:
            raise ConfigError(
                f"config field 'quantization_config' ({method!r}, format {fmt!r}) is not supported; "
                "tidal reads compressed-tensors 'mxfp4-pack-quantized' routed experts"
            )

    eos = outer.get("eos_token_id", text.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    gate_lb = lac.get("gate_lower_bound", float, None)
    hidden_act = f.get("hidden_act", str)
    if hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"config field '{prefix}hidden_act' is {hidden_act!r}; supported: {SUPPORTED_ACTIVATIONS}")
    num_experts = f.get("num_experts", int, 0)
    hidden_size = f.positive("hidden_size")
    vision = None
    if model_type == "kimi_k3" and outer.get("vision_config") is not None:
        from tidal.model.vision.config import parse_vision_config

        vision = parse_vision_config(outer["vision_config"], hidden_size, model_dir)
    media_id = outer.get("media_placeholder_token_id")
    if media_id is not None and (not isinstance(media_id, int) or isinstance(media_id, bool) or media_id < 0):
        raise ConfigError(f"config field 'media_placeholder_token_id' must be a token id, got {media_id!r}")
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=f.positive("vocab_size"),
        hidden_size=hidden_size,
        num_hidden_layers=n_layers,
        rms_norm_eps=f.get("rms_norm_eps", float),
        tie_word_embeddings=bool(outer.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position_embeddings=f.get(
            "max_position_embeddings", int, text.get("model_max_length", 1 << 20)
        ),
        kda_layers=tuple(sorted(i - 1 for i in kda_1)),
        mla_layers=tuple(sorted(i - 1 for i in mla_1)),
        kda_num_heads=lac.positive("num_heads"),
        kda_head_dim=lac.positive("head_dim"),
        kda_conv_kernel=lac.positive("short_conv_kernel_size", 4),
        kda_full_rank_gate=lac.get("use_full_rank_gate", bool, False),
        kda_gate_lower_bound=gate_lb,
        kda_a_log_layout=lac.get("a_log_layout", str, "head"),
        num_attention_heads=n_heads,
        q_lora_rank=f.get("q_lora_rank", int, None),
        kv_lora_rank=f.positive("kv_lora_rank"),
        qk_nope_head_dim=f.positive("qk_nope_head_dim"),
        qk_rope_head_dim=f.get("qk_rope_head_dim", int),
        v_head_dim=f.positive("v_head_dim"),
        mla_use_output_gate=f.get("mla_use_output_gate", bool, False),
        hidden_act=hidden_act,
        situ_beta=f.get("activation_situ_beta", float, 4.0),
        situ_linear_beta=f.get("activation_situ_linear_beta", float, 25.0),
        intermediate_size=f.positive("intermediate_size"),
        first_k_dense_replace=f.get("first_k_dense_replace", int, 0),
        moe_layer_freq=f.positive("moe_layer_freq", 1),
        num_experts=num_experts,
        num_experts_per_token=f.get("num_experts_per_token", int, f.get("num_experts_per_tok", int, 0)),
        num_shared_experts=f.get("num_shared_experts", int, 0),
        moe_intermediate_size=f.get("moe_intermediate_size", int, 0),
        routed_scaling_factor=f.get("routed_scaling_factor", float, 1.0),
        moe_renormalize=f.get("moe_renormalize", bool, True),
        num_expert_group=f.get("num_expert_group", int, 1),
        topk_group=f.get("topk_group", int, 1),
        routed_expert_hidden_size=f.get("routed_expert_hidden_size", int, None),
        latent_moe_use_norm=f.get("latent_moe_use_norm", bool, False),
        expert_format=expert_format,
        attn_res_block_size=f.get("attn_res_block_size", int, None),
        bos_token_id=outer.get("bos_token_id", text.get("bos_token_id")),
        eos_token_ids=eos_ids,
        pad_token_id=outer.get("pad_token_id", text.get("pad_token_id")),
        torch_dtype=str(outer.get("torch_dtype", text.get("torch_dtype", outer.get("dtype", "bfloat16")))),
        vision=vision,
        media_placeholder_token_id=media_id,
        raw=data,
    )
    return _validate(cfg)


def _validate(c: ModelConfig) -> ModelConfig:
    p = "text_config." if c.model_type == "kimi_k3" else ""
    if c.kda_a_log_layout not in A_LOG_LAYOUTS:
        raise ConfigError(f"config field '{p}linear_attn_config.a_log_layout' must be one of {A_LOG_LAYOUTS}")
    if c.kda_gate_lower_bound is not None and c.kda_gate_lower_bound >= 0:
        raise ConfigError(f"config field '{p}linear_attn_config.gate_lower_bound' must be < 0, got {c.kda_gate_lower_bound}")
    if c.qk_rope_head_dim < 0:
        raise ConfigError(f"config field '{p}qk_rope_head_dim' must be >= 0")
    if c.q_lora_rank is not None and c.q_lora_rank <= 0:
        raise ConfigError(f"config field '{p}q_lora_rank' must be > 0 or null")
    if c.num_experts:
        if not 0 < c.num_experts_per_token <= c.num_experts:
            raise ConfigError(
                f"config field '{p}num_experts_per_token' ({c.num_experts_per_token}) must be in 1..num_experts ({c.num_experts})"
            )
        if c.moe_intermediate_size <= 0:
            raise ConfigError(f"config field '{p}moe_intermediate_size' must be > 0 when num_experts > 0")
        if c.num_experts % c.num_expert_group:
            raise ConfigError(f"config field '{p}num_expert_group' ({c.num_expert_group}) must divide num_experts ({c.num_experts})")
        if not 1 <= c.topk_group <= c.num_expert_group:
            raise ConfigError(f"config field '{p}topk_group' ({c.topk_group}) must be in 1..num_expert_group")
    if c.kda_head_dim % 1 or c.kda_conv_kernel < 1:
        raise ConfigError(f"config field '{p}linear_attn_config.short_conv_kernel_size' must be >= 1")
    if c.routed_expert_hidden_size is not None and c.routed_expert_hidden_size <= 0:
        raise ConfigError(f"config field '{p}routed_expert_hidden_size' must be > 0 or null")
    if c.attn_res_block_size is not None and c.attn_res_block_size <= 0:
        raise ConfigError(f"config field '{p}attn_res_block_size' must be > 0 or null")
    if c.expert_format == "mxfp4-pack-quantized":
        for name, width in (("routed expert input width", c.expert_hidden_size), ("moe_intermediate_size", c.moe_intermediate_size)):
            if width % 32:
                raise ConfigError(f"{name} {width} is not a multiple of 32, required by mxfp4-pack-quantized")
    parse_dtype(c.torch_dtype)
    return c
