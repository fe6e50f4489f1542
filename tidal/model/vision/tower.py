"""MoonViT: the Kimi K2.5 / K3 vision tower, as the math (vision.md §1, §5).

patches [N, 3, p, p] -> conv patch embedding + the learned position table resampled to the image's
grid -> L pre-norm blocks of bidirectional attention with 2-D rotary embedding and an MLP ->
final norm -> 2x2 merge [N/4, 4, D]. Module names are the original checkpoint's
(``vision_tower.encoder.blocks.N.wqkv`` ...), and ``wqkv`` keeps its layout: q, k, v in thirds and
every head's rotary pairs interleaved (complex RoPE), so loading needs no permutation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.model.layers import compute_dtype
from tidal.model.vision.config import VisionConfig

# nn.RMSNorm(dim) with eps=None, as Moonshot's K3 tower builds it: torch takes float32's machine
# epsilon (the norm runs in float32).
VISION_RMS_EPS = torch.finfo(torch.float32).eps
LAYER_NORM_EPS = 1e-5


class VisionNorm(nn.Module):
    """LayerNorm (weight, bias; K2.5) or RMSNorm (weight; K3), computed in at least float32."""

    def __init__(self, dim: int, norm_type: str, eps: float | None = None) -> None:
        super().__init__()
        self.norm_type = norm_type
        self.weight = nn.Parameter(torch.ones(dim))
        if norm_type == "layernorm":
            self.bias = nn.Parameter(torch.zeros(dim))
            self.eps = LAYER_NORM_EPS if eps is None else eps
        else:
            self.bias = None
            self.eps = VISION_RMS_EPS if eps is None else eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = compute_dtype(x.dtype)
        xf = x.to(dt)
        w = self.weight.to(dt)
        if self.bias is not None:
            y = F.layer_norm(xf, (xf.shape[-1],), w, self.bias.to(dt), self.eps)
        else:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w
        return y.to(x.dtype)


class PositionTable(nn.Module):
    """The learned [H0, W0, D] position table, resampled to each image's (h, w) patch grid."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.mode = c.interpolation_mode
        self.weight = nn.Parameter(torch.zeros(c.pos_emb_height, c.pos_emb_width, c.hidden_size))

    def forward(self, h: int, w: int) -> torch.Tensor:
        """[h * w, D] in raster order, in the table's compute dtype."""
        table = self.weight.to(compute_dtype(self.weight.dtype))
        if (h, w) != tuple(table.shape[:2]):
            grid = table.permute(2, 0, 1).unsqueeze(0)
            table = F.interpolate(grid, size=(h, w), mode=self.mode, align_corners=False)[0].permute(1, 2, 0)
        return table.reshape(h * w, -1)


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, c.hidden_size, c.patch_size, stride=c.patch_size, bias=c.patch_embed_bias)
        self.pos_emb = PositionTable(c)

    def forward(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        # A p x p convolution with stride p over one p x p patch is a linear map of its pixels.
        x = F.linear(patches.reshape(patches.shape[0], -1).to(self.proj.weight.dtype),
                     self.proj.weight.reshape(self.proj.weight.shape[0], -1), self.proj.bias)
        return x + self.pos_emb(h, w).to(x.dtype)


def rope_angles(h: int, w: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[h * w, head_dim / 2] float32 angles: pair 2i turns by col * f_i, pair 2i+1 by row * f_i,
    f_i = theta^(-4i / head_dim) (Moonshot's Rope2DPosEmb; the x angle first)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device, dtype=torch.float32)[: head_dim // 4] / head_dim)
    rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)
    cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)
    return torch.stack([torch.outer(cols, freqs), torch.outer(rows, freqs)], dim=-1).reshape(h * w, -1)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, hd] with (2i, 2i+1) rotated as one complex number; cos/sin [N, hd/2]."""
    xf = x.to(cos.dtype).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).reshape(x.shape).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.linear_bias)
        self.fc1 = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.norm0 = VisionNorm(c.hidden_size, c.norm_type)
        self.norm1 = VisionNorm(c.hidden_size, c.norm_type)
        self.wqkv = nn.Linear(c.hidden_size, 3 * c.qkv_hidden_size, bias=c.attn_bias)
        self.wo = nn.Linear(c.qkv_hidden_size, c.hidden_size, bias=c.attn_bias)
        self.mlp = VisionMLP(c)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_interleaved_rope(q, cos, sin), apply_interleaved_rope(k, cos, sin)
        # Bidirectional over the one image's patches; scale head_dim^-0.5 (SDPA's default).
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(out.transpose(0, 1).reshape(n, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), cos, sin)
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.num_hidden_layers))
        self.final_layernorm = VisionNorm(c.hidden_size, c.norm_type)


class MoonViT(nn.Module):
    """``vision_tower``: one image's patches -> merged patch features [h/2 * w/2, 4, D]."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.encoder = VisionEncoder(c)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """patches [h * w, 3, p, p] in raster order of the (h, w) patch grid."""
        h, w = grid
        kh, kw = self.config.merge_kernel_size
        if patches.shape[0] != h * w or h % kh or w % kw:
            raise ValueError(f"{patches.shape[0]} patches for a {h}x{w} grid (merge kernel {kh}x{kw})")
        x = self.patch_embed(patches, h, w)
        angles = rope_angles(h, w, self.config.head_dim, self.config.rope_theta, x.device)
        cos, sin = angles.cos(), angles.sin()
        for block in self.encoder.blocks:
            x = block(x, cos, sin)
        x = self.encoder.final_layernorm(x)
        # Each kh x kw block of the grid becomes one token, its patches in raster order.
        x = x.view(h // kh, kh, w // kw, kw, -1).permute(0, 2, 1, 3, 4)
        return x.reshape((h // kh) * (w // kw), kh * kw, -1)


class PatchMergerProjector(nn.Module):
    """``mm_projector``: merged features [N, 4, D] -> text embeddings [N, text_hidden].
    patchmerger (K2.5): LayerNorm per patch, proj.0 + GELU + proj.2 with biases.
    patchmergerv2 (K3): proj.0 + GELU + proj.2 without biases, then an RMSNorm (post_norm)."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        width = c.mm_hidden_size * c.merge_size
        v2 = c.projector_type == "patchmergerv2"
        if not v2:
            self.pre_norm = VisionNorm(c.mm_hidden_size, "layernorm", c.projector_ln_eps)
        self.proj = nn.Sequential(
            nn.Linear(width, width, bias=not v2), nn.GELU(), nn.Linear(width, c.text_hidden_size, bias=not v2)
        )
        if v2:
            self.post_norm = VisionNorm(c.text_hidden_size, "rmsnorm", c.projector_ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "pre_norm"):
            x = self.pre_norm(x)
        x = self.proj(x.reshape(x.shape[0], -1))
        if hasattr(self, "post_norm"):
            x = self.post_norm(x)
        return x


class KimiVisionModel(nn.Module):
    """Tower + projector under their checkpoint names, for use without the text model."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.vision_tower = MoonViT(c)
        self.mm_projector = PatchMergerProjector(c)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        return self.mm_projector(self.vision_tower(patches, grid))
