"""Random initialisation for fresh models (tests, the random embedded model, training from scratch)."""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float | None = None) -> nn.Module:
    """Seeded init: projections ~ N(0, 1/fan_in) (or ``std``), norms 1, AttnRes queries and router
    bias small, KDA decay parameters in their usual ranges. Deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, s: float) -> None:
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(s).to(p.dtype))

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if leaf == "A_log":
            p.copy_(torch.empty(p.shape, dtype=torch.float64).uniform_(1.0, 16.0, generator=gen).log().to(p.dtype))
        elif leaf == "dt_bias":
            normal(p, 0.1)
        elif leaf == "e_score_correction_bias":
            normal(p, 0.01)
        elif parent.endswith("_res_proj"):
            normal(p, 0.1)
        elif parent.endswith("norm") or parent.endswith("layernorm") or "norm" in parent:
            p.copy_(1.0 + torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(0.05).to(p.dtype))
        elif leaf.endswith("conv1d") or "conv1d" in parent:
            normal(p, 0.5)
        elif p.dim() >= 2:
            fan_in = p.shape[-1]
            normal(p, std if std is not None else 1.0 / math.sqrt(fan_in))
        else:
            normal(p, 0.02)
    return model
