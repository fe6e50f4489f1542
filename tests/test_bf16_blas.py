"""Many bfloat16 rows through torch's matmul (tidal.ops.bf16_blas): where it applies, what it computes,
and that deterministic inference and float32 models never take it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tidal.ops import batch_invariant, bf16_blas, dense, mxfp4_moe
from tidal.ops.cpu_kernels import bf16_gemm_kernel, bf16_rows_kernel, mxfp4_dequantize_bf16_kernel, mxfp4_kernels
from tidal.ops.mxfp import dequantize_mxfp4, quantize_mxfp4
from tidal.ops.mxfp4_table import ExpertTable

needs_kernels = pytest.mark.skipif(mxfp4_kernels() is None or bf16_rows_kernel() is None, reason="no C compiler here")


@pytest.fixture
def blas_from_16(monkeypatch):
    monkeypatch.setenv("TIDAL_BF16_BLAS_MIN_ROWS", "16")


def test_min_rows_switch(monkeypatch):
    monkeypatch.setenv("TIDAL_BF16_BLAS_MIN_ROWS", "0")
    assert bf16_blas.min_rows() is None and not bf16_blas.takes(4096)
    monkeypatch.setenv("TIDAL_BF16_BLAS_MIN_ROWS", "24")
    assert bf16_blas.min_rows() == 24 and bf16_blas.takes(24) and not bf16_blas.takes(23)
    with batch_invariant.deterministic_mode():
        assert not bf16_blas.takes(4096)
    assert bf16_blas.min_rows(expert=True) == 24
    monkeypatch.delenv("TIDAL_BF16_BLAS_MIN_ROWS")
    assert bf16_blas.min_rows() == (bf16_blas.MIN_ROWS if bf16_blas._amx() else None)
    assert bf16_blas.min_rows(expert=True) == (bf16_blas.MIN_EXPERT_ROWS if bf16_blas._amx() else None)


@needs_kernels
@pytest.mark.parametrize("rows", [3, 15, 16, 40])
def test_linear_takes_torch_from_min_rows_and_c_below(blas_from_16, rows):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen).bfloat16(), torch.randn(70, 96, generator=gen).bfloat16()
    got = dense.linear(x, w)
    c_form = bf16_rows_kernel()(x, w)
    assert torch.equal(got, F.linear(x, w) if rows >= 16 else c_form)
    ref = x.double() @ w.double().t()
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2)
    with batch_invariant.deterministic_mode():  # the row-invariant kernel at every row count
        assert torch.equal(dense.linear(x, w), c_form)
    x32 = x.float()  # float32 rows never leave the C kernel (float32 models are batch-invariant)
    assert torch.equal(dense.linear(x32, w), bf16_gemm_kernel()(x32, w))


@needs_kernels
def test_linear_parts_take_torch_from_min_rows(blas_from_16):
    gen = torch.Generator().manual_seed(7)
    ws = [torch.randn(n, 64, generator=gen).bfloat16() for n in (32, 17, 50)]
    x = torch.randn(20, 64, generator=gen).bfloat16()
    got = dense.linear_parts(x, dense.weight_parts(ws))
    assert torch.equal(got, F.linear(x, torch.cat(ws)))  # the bits of the parts fused
    few = dense.linear_parts(x[:5], ws)
    assert torch.equal(few, bf16_rows_kernel()(x[:5], torch.cat(ws)))


def _experts(E: int, N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    packed, scales = quantize_mxfp4(torch.randn(E, N, K, generator=gen))
    # every scale byte class: the smallest (a float32 subnormal scale), small, around 1, large
    scales[0, :4, 0] = torch.tensor([0, 1, 2, 3], dtype=torch.uint8)
    scales[1 % E, :3, 0] = torch.tensor([126, 127, 128], dtype=torch.uint8)
    scales[2 % E, :2, 0] = torch.tensor([150, 160], dtype=torch.uint8)
    return packed, scales


@needs_kernels
@pytest.mark.parametrize("parts", [1, 2])
def test_bf16_dequantise_is_exact(parts):
    E, N, K = 3, 40, 96
    packed, scales = _experts(E, N, K, seed=parts)
    if parts == 1:
        table = ExpertTable.stacked(packed, scales)
    else:  # each expert's halves apart (gate and up as a checkpoint's mapping holds them)
        table = ExpertTable.of_parts([[(packed[e, : N // 2], scales[e, : N // 2]), (packed[e, N // 2 :], scales[e, N // 2 :])]
                                      for e in range(E)])
    for e in range(E):
        got = mxfp4_dequantize_bf16_kernel()(table, e)
        assert got.dtype == torch.bfloat16 and got.shape == (N, K)
        assert torch.equal(got.float(), dequantize_mxfp4(packed[e], scales[e], torch.float32))


@needs_kernels
def test_bf16_dequantise_portable_build_has_the_same_bits(tmp_path):
    script = (
        "import torch\n"
        "from tidal.ops.cpu_kernels import mxfp4_dequantize_bf16_kernel\n"
        "from tidal.ops.mxfp import quantize_mxfp4\n"
        "from tidal.ops.mxfp4_table import ExpertTable\n"
        "p, s = quantize_mxfp4(torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(3)))\n"
        "s[0, :2] = 0\n"
        "print(mxfp4_dequantize_bf16_kernel()(ExpertTable.stacked(p, s), 0).view(torch.int16).sum().item())\n"
    )
    sums = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "TIDAL_CPU_PORTABLE": flag,
                                "TIDAL_CACHE_DIR": str(tmp_path)}).stdout for flag in ("0", "1")]
    assert sums[0] == sums[1] and sums[0].strip()


@needs_kernels
def test_grouped_matmul_many_rows_through_torch(blas_from_16):
    """Groups of at least 16 rows: their expert dequantised to bf16 and torch's product of the bf16
    rows; smaller groups: the C kernel's rows bit for bit; all within bf16 roundings of float64."""
    E, N, K = 6, 48, 64
    packed, scales = _experts(E, N, K, seed=11)
    counts = [20, 3, 0, 16, 1, 40]
    offsets = torch.tensor([0, *counts]).cumsum(0)
    experts = torch.arange(E)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(counts), K, generator=gen).bfloat16()
    got = mxfp4_moe.grouped_matmul(x, offsets, experts, counts, list(range(E)), packed, scales, bf16_rows=True)
    c_form = mxfp4_kernels()[0](x, offsets, experts, packed, scales)
    start = 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        w = dequantize_mxfp4(packed[e], scales[e], torch.float32)
        want = F.linear(x[rows], w.bfloat16()).float() if n >= 16 else c_form[rows]
        assert torch.equal(got[rows], want), e
        ref = x[rows].double() @ w.double().t()
        if n:
            torch.testing.assert_close(got[rows].double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
        start += n
    # not a bfloat16 model's rows, or deterministic inference: the C kernel throughout (there with the
    # AMX tiles off, so against the C kernel's bits in that mode)
    assert torch.equal(mxfp4_moe.grouped_matmul(x, offsets, experts, counts, list(range(E)), packed, scales), c_form)
    with batch_invariant.deterministic_mode():
        c_deterministic = mxfp4_kernels()[0](x, offsets, experts, packed, scales)
        assert torch.equal(mxfp4_moe.grouped_matmul(x, offsets, experts, counts, list(range(E)), packed, scales,
                                                    bf16_rows=True), c_deterministic)


@needs_kernels
def test_bf16_engine_prefill_logits_with_torch_products_within_bf16_roundings(monkeypatch):
    """The embedded model in bfloat16: a 200-token prompt's last logits with many-row products in
    torch's matmul against the C kernels', and the float32 model's (the reference) against both."""
    from tidal import LLM, SamplingParams
    from tidal.embedded import embedded_model_dir

    prompt = {"prompt_token_ids": [(i * 37 + 11) % 250 for i in range(200)]}
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)

    def top(dtype: str, min_rows: str) -> dict:
        monkeypatch.setenv("TIDAL_BF16_BLAS_MIN_ROWS", min_rows)
        llm = LLM(str(embedded_model_dir()), dtype=dtype, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
        out = llm.generate(prompt, params)[0].outputs[0]
        return {t: lp.logprob for t, lp in out.logprobs[0].items()}

    blas, c_form, ref = top("bfloat16", "16"), top("bfloat16", "0"), top("float32", "0")
    assert max(blas, key=blas.get) == max(c_form, key=c_form.get) == max(ref, key=ref.get)
    for t in set(blas) & set(ref):
        assert abs(blas[t] - ref[t]) < 0.15 and abs(c_form[t] - ref[t]) < 0.15
