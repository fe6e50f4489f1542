"""Kimi Delta Attention layer (spec §1): projections, short conv, gates, KDA kernel, gated norm."""

from __future__ import annotations

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.model.context import ForwardBatch
from tidal.model.layers import linear


class KimiDeltaAttention(nn.Module):
    """Parameter names match the checkpoint (``layers.{i}.self_attn.*``).

    ``A_log`` is held as [H, 1] (layout "head": one value per head, the first H of the checkpoint's
    vector) or [1, K] (layout "channel"); the loader narrows/reshapes the stored tensor.
    """

    def __init__(self, config: ModelConfig, kda_index: int) -> None:
        super().__init__()
        self.config = config
        self.kda_index = kda_index
        d = config.hidden_size
        H, K, W = config.kda_num_heads, config.kda_head_dim, config.kda_conv_kernel
        P = H * K
        self.num_heads, self.head_dim, self.conv_kernel = H, K, W
        self.q_proj = linear(d, P)
        self.k_proj = linear(d, P)
        self.v_proj = linear(d, P)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.f_a_proj = linear(d, K)
        self.f_b_proj = linear(K, P)
        self.b_proj = linear(d, H)
        a_log_shape = (H, 1) if config.kda_a_log_layout == "head" else (1, K)
        self.A_log = nn.Parameter(torch.zeros(a_log_shape, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        if config.kda_full_rank_gate:
            self.g_proj = linear(d, P)
        else:
            self.g_a_proj = linear(d, K)
            self.g_b_proj = linear(K, P)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K, dtype=torch.float32))
        self.o_proj = linear(P, d)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes this layer's state in ``batch.cache``."""
        raise NotImplementedError
