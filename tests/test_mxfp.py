"""MXFP4 decode/encode against the OCP MX v1.0 definitions, computed here independently."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.ops.mxfp import ZERO_BLOCK_SCALE, dequantize_mxfp4, fake_quantize_mxfp4, quantize_mxfp4


def e2m1_value(code: int) -> float:
    """FP4 E2M1 from its bits: sign(1) exponent(2, bias 1) mantissa(1); exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    magnitude = (man / 2) if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return sign * magnitude


GRID = sorted({abs(e2m1_value(c)) for c in range(8)})


def pack(codes: list[list[int]]) -> torch.Tensor:
    """Rows of 4-bit codes -> bytes, even column in the low nibble (the spec's layout)."""
    return torch.tensor([[r[2 * j] | (r[2 * j + 1] << 4) for j in range(len(r) // 2)] for r in codes], dtype=torch.uint8)


def reference_quantize(v: list[float]) -> tuple[int, list[float]]:
    """One block of 32, straight from the spec: scale byte and the dequantised values.
    Nearest grid point of |v|/X, ties to the even code (even mantissa), saturating at 6."""
    amax = max(abs(x) for x in v)
    if amax == 0:
        return None, [0.0] * len(v)
    shared = max(-127, min(127, math.floor(math.log2(amax)) - 2))
    X = 2.0**shared
    out = []
    for x in v:
        a = min(abs(x) / X, 6.0)
        dist = [abs(a - g) for g in GRID]
        best = min(dist)
        idx = [i for i, d in enumerate(dist) if d == best]
        i = idx[0] if len(idx) == 1 else next(i for i in idx if i % 2 == 0)
        out.append(math.copysign(GRID[i] * X, x))
    return shared + 127, out


def test_e2m1_table_from_definition():
    assert [e2m1_value(c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


@pytest.mark.parametrize("scale_byte", [0, 1, 100, 127, 128, 200, 254])
def test_every_code_and_scale_decodes_exactly(scale_byte):
    codes = [list(range(16)) * 2]  # every code, at even and odd columns
    packed = pack(codes)
    scales = torch.tensor([[scale_byte]], dtype=torch.uint8)
    out = dequantize_mxfp4(packed, scales, torch.float64)
    assert out.shape == (1, 32) and out.dtype == torch.float64
    want = [e2m1_value(c) * 2.0 ** (scale_byte - 127) for c in codes[0]]
    assert out[0].tolist() == want
    # -0 (code 8) keeps its sign
    assert torch.signbit(out[0, 8]) and not torch.signbit(out[0, 0])
    # float32 is exact wherever the value fits float32's range
    out32 = dequantize_mxfp4(packed, scales, torch.float32)[0].tolist()
    for got, w in zip(out32, want):
        if abs(w) < 3.4e38:
            assert got == w
        else:
            assert math.isinf(got) and math.copysign(1, got) == math.copysign(1, w)


def test_bf16_decode_exact_and_shape():
    torch.manual_seed(0)
    packed = torch.randint(0, 256, (5, 48), dtype=torch.uint8)
    scales = torch.randint(100, 150, (5, 3), dtype=torch.uint8)
    ref = dequantize_mxfp4(packed, scales, torch.float64)
    out = dequantize_mxfp4(packed, scales, torch.bfloat16)
    assert out.shape == (5, 96) and out.dtype == torch.bfloat16
    assert torch.equal(out.double(), ref)
    for r in range(5):
        for j in range(48):
            byte = int(packed[r, j])
            X = 2.0 ** (int(scales[r, (2 * j) // 32]) - 127)
            assert ref[r, 2 * j].item() == e2m1_value(byte & 0xF) * X
            assert ref[r, 2 * j + 1].item() == e2m1_value(byte >> 4) * X


def test_scale_255_is_an_error():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    scales = torch.tensor([[127], [255]], dtype=torch.uint8)
    with pytest.raises(ValueError, match="255"):
        dequantize_mxfp4(packed, scales, torch.float32)


def test_nibble_order_low_nibble_is_even_column():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x71  # low nibble 1 (0.5), high nibble 7 (6.0)
    packed[0, 1] = 0xA2  # low 2 (1.0), high 0xA (-1.0)
    out = dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8), torch.float32)[0]
    assert out[:4].tolist() == [0.5, 6.0, 1.0, -1.0]
    assert not out[4:].any()


def test_quantize_round_to_nearest_even_at_scale_one():
    # max 6 -> shared_exp = floor(log2 6) - 2 = 0: elements are quantised at scale 1
    values = [6.0, 2.5, 3.5, 0.25, 0.75, 1.25, 1.75, 5.0, -2.5, -0.25, 2.4, 2.6, 4.9, 5.1]
    expect = [6.0, 2.0, 4.0, 0.0, 1.0, 1.0, 2.0, 4.0, -2.0, -0.0, 2.0, 3.0, 4.0, 6.0]
    w = torch.tensor([values + [0.0] * (32 - len(values))])
    packed, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127]]
    assert dequantize_mxfp4(packed, scales, torch.float32)[0, : len(values)].tolist() == expect


def test_quantize_saturates():
    # max 7.5 -> shared_exp = floor(log2 7.5) - 2 = 0, so 7.5 and 6.5 exceed the E2M1 max and clamp to 6
    w = torch.tensor([[7.5, -7.5, 6.5, 1.0] + [0.0] * 28])
    packed, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127]]
    assert dequantize_mxfp4(packed, scales, torch.float32)[0, :4].tolist() == [6.0, -6.0, 6.0, 1.0]


def test_zero_blocks():
    w = torch.zeros(2, 64)
    w[1, 40] = 3.0  # second block of row 1 is non-zero
    packed, scales = quantize_mxfp4(w)
    assert scales[0].tolist() == [ZERO_BLOCK_SCALE, ZERO_BLOCK_SCALE]
    assert scales[1, 0].item() == ZERO_BLOCK_SCALE and ZERO_BLOCK_SCALE in (0, 127)
    assert scales[1, 1].item() == 127 + math.floor(math.log2(3.0)) - 2
    assert not packed[0].any()
    assert torch.equal(dequantize_mxfp4(packed, scales, torch.float32), w)


def test_quantize_matches_reference_on_random_blocks():
    torch.manual_seed(1)
    rows = [torch.randn(64) * s for s in (1.0, 1e-3, 300.0, 1e-30)]
    rows.append(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4 + [4.0] * 4 + [0.0] * 32) * 2.0**-5)
    w = torch.stack(rows)
    packed, scales = quantize_mxfp4(w)
    out = dequantize_mxfp4(packed, scales, torch.float64)
    for r in range(w.shape[0]):
        for b in range(2):
            block = w[r, 32 * b : 32 * (b + 1)].double().tolist()
            byte, values = reference_quantize(block)
            if byte is not None:
                assert scales[r, b].item() == byte
            assert out[r, 32 * b : 32 * (b + 1)].tolist() == values


def test_round_trip_on_grid_is_exact():
    torch.manual_seed(2)
    packed = torch.randint(0, 256, (16, 64), dtype=torch.uint8)
    scales = torch.randint(10, 240, (16, 4), dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        w = dequantize_mxfp4(packed, scales, dtype)
        again = dequantize_mxfp4(*quantize_mxfp4(w), dtype=dtype)
        assert torch.equal(again, w)


def test_random_normal_error_within_bounds():
    torch.manual_seed(3)
    w = torch.randn(128, 256)
    packed, scales = quantize_mxfp4(w)
    q = dequantize_mxfp4(packed, scales, torch.float32)
    X = (2.0 ** (scales.double() - 127)).repeat_interleave(32, dim=1)
    a = w.double().abs() / X
    half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0)) * X
    err = (q.double() - w.double()).abs()
    normal = a <= 6
    assert (err[normal] <= half_step[normal]).all()
    assert (err[~normal] <= (a[~normal] - 6) * X[~normal] + 1e-30).all()  # saturated: clamp to 6X
    # every element's error is below a quarter of its block max (a = |v|/X < 8, block max >= 4X)
    block_max = w.abs().reshape(128, 8, 32).amax(-1).repeat_interleave(32, dim=1).double()
    assert (err <= block_max / 4).all()
    rel_rms = (err.pow(2).mean() / w.double().pow(2).mean()).sqrt().item()
    assert 0.05 < rel_rms < 0.15  # 4-bit with a shared power-of-two scale: about 0.1


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.ones(2, 48))
    bad = torch.ones(1, 32)
    bad[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_mxfp4(bad)


def test_fake_quantize_forward_and_straight_through_gradient():
    torch.manual_seed(4)
    w = torch.randn(8, 64, requires_grad=True)
    y = fake_quantize_mxfp4(w)
    assert torch.equal(y.detach(), dequantize_mxfp4(*quantize_mxfp4(w.detach()), dtype=torch.float32))
    assert not torch.equal(y.detach(), w.detach())
    g = torch.randn(8, 64)
    (y * g).sum().backward()
    assert torch.equal(w.grad, g)


def test_leading_dims_match_per_matrix():
    torch.manual_seed(5)
    w = torch.randn(3, 8, 64, dtype=torch.bfloat16)
    packed, scales = quantize_mxfp4(w)
    assert packed.shape == (3, 8, 32) and scales.shape == (3, 8, 2)
    for e in range(3):
        p, s = quantize_mxfp4(w[e])
        assert torch.equal(packed[e], p) and torch.equal(scales[e], s)
