"""Dense MLP, sigmoid-routed MoE with shared experts, and K3's latent MoE (spec §3)."""

from __future__ import annotations

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.model.layers import RMSNorm, compute_dtype, linear
from tidal.ops.activation import situ, swiglu


def activate(config: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if config.hidden_act == "situ":
        return situ(gate, up, config.situ_beta, config.situ_linear_beta)
    return swiglu(gate, up)


class KimiMLP(nn.Module):
    """gate/up/down MLP: the dense first layer(s) and the shared experts."""

    def __init__(self, config: ModelConfig, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.config = config
        self.gate_proj = linear(hidden, intermediate)
        self.up_proj = linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activate(self.config, self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    """DeepSeek-V3 "noaux_tc" routing: fp32 sigmoid scores; the correction bias only chooses."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (expert ids [T, k], weights [T, k] in float32 or wider)."""
        c = self.config
        ct = compute_dtype(x.dtype)
        scores = torch.sigmoid(x.to(ct) @ self.weight.to(ct).t())
        key = scores + self.e_score_correction_bias.to(ct)
        if c.num_expert_group > 1 and c.topk_group < c.num_expert_group:
            grouped = key.view(key.shape[0], c.num_expert_group, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = group_score.topk(c.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            key = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view_as(key)
        ids = key.topk(c.num_experts_per_token, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.moe_renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor


class Experts(nn.Module):
    """All routed experts of a layer, stacked: w1/w3 [E, I, d_e], w2 [E, d_e, I].

    The checkpoint stores them one by one (``experts.{e}.w1.weight``); the loader stacks them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        E, d, inter = config.num_experts, config.expert_hidden_size, config.moe_intermediate_size
        self.w1 = nn.Parameter(torch.zeros(E, inter, d))
        self.w3 = nn.Parameter(torch.zeros(E, inter, d))
        self.w2 = nn.Parameter(torch.zeros(E, d, inter))

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of weight * expert(h). Tokens are grouped by expert:
        one matmul per active expert, no per-token loop."""
        T, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        token_of = order // k
        w_sorted = weights.reshape(-1)[order]
        out = torch.zeros(T, h.shape[-1], dtype=compute_dtype(h.dtype), device=h.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start : start + n]
            x = h[rows]
            y = activate(self.config, x @ self.w1[e].t(), x @ self.w3[e].t()) @ self.w2[e].t()
            out.index_add_(0, rows, y.to(out.dtype) * w_sorted[start : start + n, None].to(out.dtype))
            start += n
        return out


class KimiMoE(nn.Module):
    """``block_sparse_moe``: router on x, routed experts (at the latent width for K3), shared
    experts on the original x."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.gate = Router(config)
        self.experts = Experts(config)
        if config.num_shared_experts:
            self.shared_experts = KimiMLP(config, d, config.moe_intermediate_size * config.num_shared_experts)
        if config.is_latent_moe:
            de = config.expert_hidden_size
            self.routed_expert_down_proj = linear(d, de)
            self.routed_expert_up_proj = linear(de, d)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(de, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        h = self.routed_expert_down_proj(x) if self.config.is_latent_moe else x
        y = self.experts(h, ids, weights).to(x.dtype)
        if self.config.is_latent_moe:
            if self.config.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.config.num_shared_experts:
            y = y + self.shared_experts(x)
        return y
