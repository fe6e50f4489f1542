"""Multi-head latent attention (spec §2): NoPE, optional q-LoRA, optional sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.model.context import ForwardBatch
from tidal.model.layers import RMSNorm, linear


class KimiMLA(nn.Module):
    """Parameter names match the checkpoint (``layers.{i}.self_attn.*``)."""

    def __init__(self, config: ModelConfig, mla_index: int) -> None:
        super().__init__()
        self.config = config
        self.mla_index = mla_index
        d, n = config.hidden_size, config.num_attention_heads
        self.num_heads = n
        self.qk_nope, self.qk_rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        q_out = n * config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = linear(d, q_out)
        else:
            self.q_a_proj = linear(d, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = linear(config.q_lora_rank, q_out)
        self.kv_a_proj_with_mqa = linear(d, config.kv_lora_rank + config.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = linear(config.kv_lora_rank, n * (config.qk_nope_head_dim + config.v_head_dim))
        if config.mla_use_output_gate:
            self.g_proj = linear(d, n * config.v_head_dim)
        self.o_proj = linear(n * config.v_head_dim, d)
        self.scale = config.qk_head_dim ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; appends this step's latents to ``batch.cache``."""
        raise NotImplementedError
