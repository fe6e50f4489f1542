"""Packed MXFP4 experts (tidal.ops.mxfp4_moe, csrc/mxfp4_gemm.c, PackedExperts) against a float64
reference on fresh random codes and scales; torch form == C kernel; batch invariance; fallbacks."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from tidal.ops import cpu_kernels, mxfp4_moe
from tidal.ops.mxfp import E2M1_VALUES

# Scale bytes of every class: the subnormal 2^-127 (0), the smallest normals, around 1.0 (127), and
# large ones; 255 (NaN) is refused by the loader, and from 253 up the largest codes overflow float32
# (as dequantize's values do).
SCALE_CLASSES = torch.tensor([0, 1, 2, 60, 100, 120, 125, 126, 127, 128, 129, 135, 150, 200, 250, 252],
                             dtype=torch.uint8)


def random_experts(gen: torch.Generator, E: int, N: int, K: int, scale_bytes: torch.Tensor | None = None):
    packed = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8)
    if scale_bytes is None:  # near 1.0: outputs stay in a range where fp32 rounding is the only error
        scales = torch.randint(118, 131, (E, N, K // 32), generator=gen, dtype=torch.uint8)
    else:
        pick = torch.randint(0, len(scale_bytes), (E, N, K // 32), generator=gen)
        scales = scale_bytes[pick]
    return packed, scales


def reference(x: torch.Tensor, counts: list[int], experts: list[int], packed: torch.Tensor,
              scales: torch.Tensor) -> torch.Tensor:
    """float64, element by element from the codes: low nibble = even column; scale 2^(s-127)."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()  # [E, N, K]
    s = scales.double()
    scale = torch.where(scales == 0, torch.tensor(2.0**-127, dtype=torch.float64), torch.exp2(s - 127))
    w = values[codes] * scale.repeat_interleave(32, dim=-1)
    return torch.cat([r.double() @ w[e].t() for e, r in zip(experts, x.double().split(counts))])


def groups(gen: torch.Generator, E: int, counts: list[int]):
    experts = sorted(torch.randperm(E, generator=gen)[: len(counts)].tolist())
    offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    return experts, offsets, torch.tensor(experts, dtype=torch.int64)


@pytest.fixture()
def kernels():
    k = cpu_kernels.mxfp4_kernels()
    if k is None:
        pytest.skip("no C compiler here: the torch form runs")
    return k


def tolerance(x: torch.Tensor, ref_abs: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of a K-term sum: a few ulps of the sum of |terms|."""
    return 1e-6 * x.shape[1] * ref_abs + 1e-30


def check(out: torch.Tensor, x, counts, experts, packed, scales) -> None:
    ref = reference(x, counts, experts, packed, scales)
    ref_abs = reference(x.abs(), counts, experts, packed & 0x77, scales)  # codes without sign bits
    err = (out.double() - ref).abs()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert bool((err <= tolerance(x, ref_abs)).all()), f"max error {err.max()}"


@pytest.mark.parametrize("N,K,counts", [(7, 32, [1]), (65, 96, [3, 1, 16]), (130, 384, [1, 1, 1, 1]),
                                        (33, 64, [5, 2]), (64, 160, [40, 1]), (9, 1024, [1, 2, 4]),
                                        (11, 544, [1, 3])])
def test_kernel_matches_float64_reference(kernels, N, K, counts):
    """Odd shapes (N not a multiple of the chunk, K of 8 lanes x 4; rows of more than 16 scale blocks,
    which the AVX-512 tiles take 16 at a time), 1 and many rows per expert."""
    gen = torch.Generator().manual_seed(N * K)
    packed, scales = random_experts(gen, 6, N, K)
    experts, offsets, ids = groups(gen, 6, counts)
    x = torch.randn(sum(counts), K, generator=gen)
    check(kernels[0](x, offsets, ids, packed, scales), x, counts, experts, packed, scales)
    check(mxfp4_moe.grouped_matmul(x, offsets, ids, counts, experts, packed, scales), x, counts, experts, packed,
          scales)


def test_every_scale_byte_class(kernels):
    """Subnormal, tiny, unit and huge scales: values are exact, sums within fp32 rounding."""
    gen = torch.Generator().manual_seed(3)
    packed, scales = random_experts(gen, 3, 40, 256, SCALE_CLASSES)
    counts = [2, 1, 3]
    experts, offsets, ids = groups(gen, 3, counts)
    x = torch.randn(6, 256, generator=gen) * 2.0**-20  # sums stay finite at scale 2^125
    check(kernels[0](x, offsets, ids, packed, scales), x, counts, experts, packed, scales)
    # every block value itself, through dequantize: one-hot rows pick columns
    eye = torch.eye(256)[:32]
    for e in range(3):
        one = torch.tensor([0, 32]), torch.tensor([e])
        got = kernels[0](eye, *one, packed, scales)
        assert torch.equal(got.double(), reference(eye, [32], [e], packed, scales))
    # ... and in groups of 1 and 4 rows (decoded in registers, not through the panel), every column
    full = torch.eye(256)
    for e in range(3):
        for n in (1, 4):
            for j in range(0, 256, 8 if n == 1 else 4):
                got = kernels[0](full[j : j + n], torch.tensor([0, n]), torch.tensor([e]), packed, scales)
                assert torch.equal(got.double(), reference(full[j : j + n], [n], [e], packed, scales)), (e, n, j)
    assert torch.equal(kernels[1](torch.tensor([2, 0]), packed, scales).double()[1],
                       reference(torch.eye(256), [256], [0], packed, scales).t())


def test_torch_form_matches_c_kernel(kernels):
    gen = torch.Generator().manual_seed(4)
    packed, scales = random_experts(gen, 8, 96, 128)
    counts = [1, 4, 2, 20]
    experts, offsets, ids = groups(gen, 8, counts)
    x = torch.randn(sum(counts), 128, generator=gen)
    c = mxfp4_moe.grouped_matmul(x, offsets, ids, counts, experts, packed, scales)
    t = mxfp4_moe.grouped_matmul_torch(x, counts, experts, packed, scales)
    torch.testing.assert_close(c, t, rtol=1e-5, atol=1e-5)


def test_few_row_groups_equal_rows_alone_bitwise(kernels):
    """Groups of 1 to 8 rows (decoded in registers up to 4 rows, through the L1 panel past that) at an
    odd weight-row count over two chunks: each row == the same row alone, bit for bit, and all
    within fp32 rounding of the float64 reference."""
    gen = torch.Generator().manual_seed(6)
    packed, scales = random_experts(gen, 8, 101, 96)
    counts = [1, 2, 3, 4, 5, 6, 7, 8]
    experts, offsets, ids = groups(gen, 8, counts)
    x = torch.randn(sum(counts), 96, generator=gen)
    batch = kernels[0](x, offsets, ids, packed, scales)
    check(batch, x, counts, experts, packed, scales)
    start = 0
    for g, n in enumerate(counts):
        for t in range(start, start + n):
            alone = kernels[0](x[t : t + 1], torch.tensor([0, 1]), ids[g : g + 1], packed, scales)
            assert torch.equal(alone[0], batch[t]), f"row {t} of a group of {n}"
        start += n


def test_row_alone_equals_row_in_a_batch_bitwise(kernels):
    """Every row of a batch (decode-sized and prefill-sized groups) == the same row computed alone,
    and thread count changes nothing: the batch (58 rows x 200 weight rows x 12 blocks, over
    csrc/mxfp4_gemm.c's PARALLEL_MIN_WORK) runs on 2 threads, each row alone on the calling one."""
    gen = torch.Generator().manual_seed(5)
    packed, scales = random_experts(gen, 5, 200, 384)
    counts = [3, 9, 1, 45]
    experts, offsets, ids = groups(gen, 5, counts)
    x = torch.randn(sum(counts), 384, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = kernels[0](x, offsets, ids, packed, scales)
        torch.set_num_threads(1)
        start = 0
        for g, n in enumerate(counts):
            for t in range(start, start + n):
                alone = kernels[0](x[t : t + 1], torch.tensor([0, 1]), ids[g : g + 1], packed, scales)
                assert torch.equal(alone[0], batch[t])
            start += n
    finally:
        torch.set_num_threads(before)


FALLBACK_SCRIPT = """
import torch
from tidal.ops import cpu_kernels, mxfp4_moe
from tidal.ops.mxfp import dequantize_mxfp4
torch.manual_seed(0)
packed = torch.randint(0, 256, (3, 40, 32), dtype=torch.uint8)
scales = torch.randint(120, 130, (3, 40, 2), dtype=torch.uint8)
x = torch.randn(5, 64)
k = cpu_kernels.mxfp4_kernels()
out = mxfp4_moe.grouped_matmul(x, torch.tensor([0, 2, 5]), torch.tensor([0, 2]), [2, 3], [0, 2], packed, scales)
ref = torch.cat([x[:2] @ dequantize_mxfp4(packed[0], scales[0], torch.float32).t(),
                 x[2:] @ dequantize_mxfp4(packed[2], scales[2], torch.float32).t()])
torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
print("kernel" if k is not None else "torch")
"""


@pytest.mark.parametrize("env,expect", [({"TIDAL_CPU_KERNELS": "0"}, "torch"), ({"TIDAL_CPU_PORTABLE": "1"}, "kernel")])
def test_clean_fallbacks(tmp_path, env, expect):
    """Kernels off: the torch form runs. Portable forced: the kernel is built without -march=native."""
    if expect == "kernel" and cpu_kernels.mxfp4_kernels() is None:
        pytest.skip("no C compiler here")
    full = {**os.environ, "TIDAL_CACHE_DIR": str(tmp_path), **env}
    run = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=full, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == expect
    built = list((tmp_path / "kernels").glob("mxfp4_gemm-*.so"))
    assert len(built) == (1 if expect == "kernel" else 0)


def experts_apart(gen: torch.Generator, packed: torch.Tensor, scales: torch.Tensor, parts: int, pad: int):
    """The stacked experts' matrices copied apart: each expert's ``parts`` row ranges to its own place
    in one buffer, the experts in a shuffled order, every row ``pad`` bytes longer than its codes
    (and scales), as a tensor-parallel rank's columns of the file's rows are."""
    from tidal.ops.mxfp4_table import ExpertTable

    E, N, half = packed.shape
    rows = N // parts
    order = torch.randperm(E * parts, generator=gen).tolist()
    codes = torch.zeros(E * parts, rows, half + pad, dtype=torch.uint8)
    scale_rows = torch.zeros(E * parts, rows, scales.shape[2] + pad, dtype=torch.uint8)
    table, c0, k32 = [], min(1, pad), scales.shape[2]
    for e in range(E):
        mats = []
        for p in range(parts):
            at = order[e * parts + p]
            codes[at, :, c0 : c0 + half] = packed[e, p * rows : (p + 1) * rows]
            scale_rows[at, :, c0 : c0 + k32] = scales[e, p * rows : (p + 1) * rows]
            mats.append((codes[at, :, c0 : c0 + half], scale_rows[at, :, c0 : c0 + k32]))
        table.append(mats)
    return ExpertTable.of_parts(table)


@pytest.mark.parametrize("parts,pad", [(1, 0), (2, 0), (2, 7), (1, 16)])
def test_experts_apart_equal_stacked_bitwise(kernels, parts, pad):
    """The kernels on each expert's matrices wherever they are (the table of a mapped checkpoint:
    gate and up apart, experts in any order, rows longer than their codes) give the stacked experts'
    bits, at decode (one row per expert: the register path) and prefill group sizes; the torch form
    on the table equals it on the stacked tensors."""
    gen = torch.Generator().manual_seed(11 + parts + pad)
    packed, scales = random_experts(gen, 6, 2 * 56, 96)  # a part of 56 rows: not a multiple of the chunk
    table = experts_apart(gen, packed, scales, parts, pad)
    for counts in ([1, 1, 1], [3, 1, 17, 2]):
        experts, offsets, ids = groups(gen, 6, counts)
        x = torch.randn(sum(counts), 96, generator=gen)
        want = kernels[0](x, offsets, ids, packed, scales)
        assert torch.equal(kernels[0](x, offsets, ids, table), want)
        assert torch.equal(mxfp4_moe.grouped_matmul(x, offsets, ids, counts, experts, table), want)
        assert torch.equal(mxfp4_moe.grouped_matmul_torch(x, counts, experts, table),
                           mxfp4_moe.grouped_matmul_torch(x, counts, experts, packed, scales))


def test_packed_experts_held_apart_equal_stacked_bitwise():
    """PackedExperts on its matrices apart (use_matrices) == the stacked module, bitwise: one token (the
    one-call C path), a decode batch and a prefill (grouped kernel); state_dict is the stacked one,
    and own_storage() gives the stacked buffers back. Writing through target() is refused."""
    from tidal.model.moe import PackedExperts
    from tidal.presets import tiny_k3

    config = tiny_k3(num_experts=6)
    gen = torch.Generator().manual_seed(12)
    stacked = PackedExperts(config)
    for name, buf in stacked.named_buffers():  # scales near 1.0
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen) if "packed" in name else
                  torch.randint(118, 131, buf.shape, generator=gen))
    inter = config.moe_intermediate_size
    apart = PackedExperts(config)
    copies = {n: b.clone() for n, b in stacked.named_buffers()}  # apart's own memory
    apart.use_matrices({
        "w1": [(copies["w13_weight_packed"][e, :inter], copies["w13_weight_scale"][e, :inter]) for e in range(6)],
        "w3": [(copies["w13_weight_packed"][e, inter:], copies["w13_weight_scale"][e, inter:]) for e in range(6)],
        "w2": [(copies["w2_weight_packed"][e], copies["w2_weight_scale"][e]) for e in range(6)],
    })
    assert apart.apart and apart.w13_weight_packed is None
    d = config.expert_hidden_size
    for T in (1, 4, 70):
        h = torch.randn(T, d, generator=gen)
        ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(T)])
        w = torch.rand(T, 2, generator=gen)
        assert torch.equal(apart(h, ids, w), stacked(h, ids, w)), T
    a, s = apart.state_dict(), stacked.state_dict()
    assert a.keys() == s.keys() and all(torch.equal(a[k], s[k]) for k in s)
    with pytest.raises(ValueError, match="held apart"):
        apart.target("w1", "packed")
    twin = copy.deepcopy(apart)  # its table addresses its own copies of the matrices
    w13 = twin.tables()[0]
    assert [int(a) for a in w13.packed[3]] == [twin.expert_matrices(leaf, 3)[0].data_ptr() for leaf in ("w1", "w3")]
    assert torch.equal(twin(h, ids, w), stacked(h, ids, w))
    apart.own_storage()
    assert not apart.apart and all(torch.equal(b, dict(stacked.named_buffers())[n]) for n, b in apart.named_buffers())
