"""MXFP4 (OCP Microscaling v1.0, spec §5): FP4 E2M1 elements in blocks of 32 along the input dim,
each block sharing one E8M0 power-of-two scale.

The layout is compressed-tensors ``mxfp4-pack-quantized`` (Kimi-K3 routed experts): ``packed`` uint8
[..., in/2] with input column 2j in the LOW nibble of byte j and 2j+1 in the high nibble, ``scales``
uint8 [..., in/32] holding the biased exponent e (block scale 2^(e-127); e=255 is NaN).
All arithmetic is exact: scales are built from their IEEE bit patterns, never from pow/log.
"""

from __future__ import annotations

import torch

BLOCK = 32
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest E2M1 normal (6 = 1.5 * 2^2)
E8M0_BIAS = 127
E8M0_NAN = 255
# All-zero block: every scale decodes zeros; we write e=127 (scale 1.0), the neutral choice that
# stays a normal number in every float format.
ZERO_BLOCK_SCALE = 127

# E2M1 magnitudes by 3-bit index (index 1 = subnormal 0.5); codes 8..15 are the negatives (8 = -0).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 holds every E2M1 x 2^(e-127) exactly (up to overflow at the top scales); float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def e8m0_to_float(scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Scale bytes -> exact 2^(e-127). Built as float32 bit patterns: exponent field e (normal, e >= 1)
    or the subnormal 2^-127 for e = 0. Raises ValueError on the NaN byte 255."""
    if scales.dtype != torch.uint8:
        raise ValueError(f"E8M0 scales must be uint8, got {scales.dtype}")
    bad = scales == E8M0_NAN
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"scale byte 255 (E8M0 NaN) at index {where}")
    e = scales.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return bits.view(torch.float32).to(dtype)


def _pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: byte -> (value of low nibble, value of high nibble)."""
    values = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack([values[byte & 0xF], values[byte >> 4]], dim=-1)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed uint8 [..., out, in/2], scales uint8 [..., out, in/32] -> weight [..., out, in] in dtype.

    Each value is E2M1(code) * 2^(e-127), rounded once to dtype (exact wherever dtype can hold it;
    beyond float32's range, i.e. e=254 with |code| >= 4, it is inf as IEEE overflow says)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed MXFP4 weights must be uint8, got {packed.dtype}")
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * BLOCK:
        raise ValueError(
            f"packed shape {list(packed.shape)} and scale shape {list(scales.shape)} disagree "
            f"(expected scales [..., in/{BLOCK}] for packed [..., in/2])"
        )
    cdt = _compute_dtype(dtype)
    scale = e8m0_to_float(scales, cdt)
    values = _pair_table(cdt, packed.device)[packed.to(torch.int64)]  # [..., in/2, 2]
    blocks = values.reshape(*scales.shape, BLOCK) * scale.unsqueeze(-1)
    return blocks.reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(dtype)


def _round_to_e2m1(a: torch.Tensor) -> torch.Tensor:
    """Non-negative magnitudes -> nearest E2M1 magnitude, ties to even mantissa, saturating at 6.
    The grid step is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; torch.round is half-to-even and an even
    multiple of the step is an even mantissa (the grid points 2 and 4 are even, so crossings agree)."""
    a = a.clamp(max=E2M1_MAX)
    return torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] -> (packed uint8 [..., out, in/2], scales uint8 [..., out, in/32]).

    OCP reference algorithm: shared_exp = floor(log2(max|v|)) - 2 clamped to [-127, 127]; elements
    v / 2^shared_exp rounded to nearest-even on the E2M1 grid with saturation to +-6. An all-zero
    block gets scale byte ZERO_BLOCK_SCALE."""
    n = w.shape[-1]
    if n % BLOCK:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {BLOCK}, got shape {list(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantise a weight holding inf or NaN to MXFP4")
    cdt = _compute_dtype(w.dtype)
    v = w.detach().to(cdt).reshape(*w.shape[:-1], n // BLOCK, BLOCK)
    amax = v.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2 amax) = exp - 1
    shared = (exp.to(torch.int32) - 1 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    shared = torch.where(amax == 0, torch.full_like(shared, ZERO_BLOCK_SCALE - E8M0_BIAS), shared)
    scales = (shared + E8M0_BIAS).to(torch.uint8)
    inverse = e8m0_to_float((2 * E8M0_BIAS - scales.to(torch.int32)).to(torch.uint8), cdt)  # 2^-shared
    q = _round_to_e2m1(v.abs() * inverse.unsqueeze(-1))
    index = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q / 2 + 4)).to(torch.uint8)
    codes = (index | (torch.signbit(v).to(torch.uint8) << 3)).reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scales


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return dequantize_mxfp4(*quantize_mxfp4(w), dtype=w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def fake_quantize_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(w)) in w's dtype, with a straight-through gradient (identity backward),
    so quantisation-aware training sees MXFP4 weights forward and full-precision updates."""
    return _FakeQuantize.apply(w)
