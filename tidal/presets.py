"""Named model configs: the published Kimi-K3 and Kimi Linear 48B, and tiny test-sized twins.

The tiny configs keep the published field names and every feature switch of their parent
(K3: q-LoRA, gated NoPE MLA, full-rank KDA gate with the -5 lower bound, latent MoE with SiTU,
Block AttnRes with >= 2 blocks, MXFP4 experts) at a size a CPU runs in milliseconds.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from tidal.config import ModelConfig

PRESET_FILES = {
    "kimi-k3": "kimi-k3.json",
    "kimi-linear-48b": "kimi-linear-48b.json",
}


def preset_dict(name: str) -> dict[str, Any]:
    try:
        filename = PRESET_FILES[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESET_FILES)}") from None
    text = resources.files("tidal.assets.presets").joinpath(filename).read_text()
    return json.loads(text)


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_dict(preset_dict(name))


def _shrink(text: dict[str, Any], hidden_size: int, num_layers: int, vocab_size: int, num_experts: int,
            top_k: int) -> None:
    """Resize a text config in place to test size; layers keep K3's pattern (every 4th and the last
    are MLA)."""
    mla = [i for i in range(1, num_layers + 1) if i % 4 == 0 or i == num_layers]
    kda = [i for i in range(1, num_layers + 1) if i not in mla]
    text.update(
        hidden_size=hidden_size, num_hidden_layers=num_layers, vocab_size=vocab_size,
        intermediate_size=2 * hidden_size, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=num_experts,
        num_experts_per_token=top_k, num_shared_experts=1, moe_intermediate_size=32,
        eos_token_id=vocab_size - 1, max_position_embeddings=4096,
    )
    text["linear_attn_config"] = dict(
        text["linear_attn_config"], full_attn_layers=mla, kda_layers=kda, num_heads=2, head_dim=16
    )


def tiny_k3_dict(
    *,
    hidden_size: int = 64,
    num_layers: int = 6,
    vocab_size: int = 256,
    attn_res_block_size: int | None = 2,
    mxfp4: bool = True,
    num_experts: int = 8,
    top_k: int = 2,
    vision: bool = False,
) -> dict[str, Any]:
    """A K3-layout config.json, every K3 feature on (q-LoRA, gated MLA, latent MoE, SiTU, AttnRes,
    MXFP4 experts unless ``mxfp4=False``), sized for tests; ``vision``: with a 2-layer K3-style
    vision tower (RMSNorm, no biases, bilinear, qkv wider than the tower)."""
    d = preset_dict("kimi-k3")
    t = d["text_config"]
    _shrink(t, hidden_size, num_layers, vocab_size, num_experts, top_k)
    t.update(
        q_lora_rank=32,
        routed_expert_hidden_size=hidden_size // 2 if hidden_size // 2 % 32 == 0 else 32,
        attn_res_block_size=attn_res_block_size,
    )
    if attn_res_block_size is None:
        del t["attn_res_block_size"]
    if not mxfp4:
        del t["quantization_config"]
    d.update(bos_token_id=vocab_size - 3, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 2)
    if vision:
        d["vision_config"] = dict(
            d["vision_config"], vt_hidden_size=32, vt_intermediate_size=64, vt_num_hidden_layers=2,
            vt_num_attention_heads=2, qkv_hidden_size=48, mm_hidden_size=32, text_hidden_size=hidden_size,
            init_pos_emb_height=8, init_pos_emb_width=8,
        )
        d["media_placeholder_token_id"] = vocab_size - 4
    else:
        d.pop("vision_config", None)
    return d


def tiny_kimi_linear_dict(
    *, hidden_size: int = 64, num_layers: int = 4, vocab_size: int = 256, num_experts: int = 8, top_k: int = 2
) -> dict[str, Any]:
    """A Kimi Linear-layout config.json (q without LoRA, softplus KDA gate, low-rank output gate,
    SwiGLU, no AttnRes), sized for tests."""
    d = preset_dict("kimi-linear-48b")
    _shrink(d, hidden_size, num_layers, vocab_size, num_experts, top_k)
    d.update(bos_token_id=vocab_size - 3, pad_token_id=vocab_size - 2)
    return d


def tiny_k3(**kw: Any) -> ModelConfig:
    return ModelConfig.from_dict(tiny_k3_dict(**kw))


def tiny_kimi_linear(**kw: Any) -> ModelConfig:
    return ModelConfig.from_dict(tiny_kimi_linear_dict(**kw))
