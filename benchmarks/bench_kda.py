"""Chunked KDA prefill kernel: tidal's kda_chunked against the previous kernel and fla's naive_chunk_kda.

    python benchmarks/bench_kda.py [--threads 1] [--repeat 7] [--gate k3|linear] [--chunk 64]

Times, in one run and interleaved, for each shape (B sequences of T tokens, H heads, K = V = 128,
float32): tidal's current ``kda_chunked``, the kernel it replaced (copied below as BASELINE) and
flash-linear-attention's ``naive_chunk_kda`` (what transformers runs on CPU). Prints the best time
of --repeat runs, the ratios, the largest difference between the kernels, and a FLOP-bound estimate:
the matmul FLOPs of the chunked algorithm at the rate a [C, K] @ [K, V] batched matmul reaches here.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from tidal.ops.kda import CHUNK, kda_chunked, kda_gate, l2_normalize

SHAPES = [(16, 128), (1, 512), (1, 128), (4, 300), (1, 2048)]  # (B, T)
H, K, V = 4, 128, 128


# ---- BASELINE: the kernel before the rewrite (tidal/ops/kda.py at commit 197a81d; code unchanged, ------
# ---- comments dropped). Sub-blocks of 8, chunk 64, one chunk at a time. ---------------------------------


def baseline_kda_chunked(q, k, v, g, beta, state, chunk_size=64):
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = state.dtype
    C = chunk_size
    n = -(-T // C)
    pad = n * C - T
    q, k, v, g = (F.pad(t.to(dt).transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta.to(dt).transpose(1, 2), (0, pad))
    sub = 8 if C % 8 == 0 else C
    masks = _BaselineMasks(C, sub, q.device)
    S = state.to(dt)
    o = torch.empty(B, H, n * C, V, dtype=dt, device=q.device)
    for i in range(n):
        sl = slice(i * C, (i + 1) * C)
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl, None]
        G = g[:, :, sl].cumsum(-2)
        a_qk, a_kk = _baseline_scores(qc, kc, G, masks)
        eG = G.exp()
        rhs = bc * torch.cat([eG * kc, vc], dim=-1)
        wu = torch.linalg.solve_triangular(bc * a_kk, rhs, upper=False, unitriangular=True)
        w, u = wu.split([K, V], dim=-1)
        v_new = u - w @ S
        o[:, :, sl] = (qc * eG) @ S + a_qk @ v_new
        g_last = G[:, :, -1:]
        S = S * g_last.transpose(-1, -2).exp() + ((g_last - G).exp() * kc).transpose(-1, -2) @ v_new
    return o[:, :, :T].transpose(1, 2).to(v.dtype), S.to(state.dtype)


class _BaselineMasks:
    def __init__(self, C, sub, device):
        nb = C // sub
        self.sub = sub
        s = torch.arange(C, device=device)
        self.before = s[None, :] < (torch.arange(nb, device=device) * sub)[:, None]
        j = torch.arange(sub, device=device)
        self.causal = j[None, :] <= j[:, None]


def _baseline_scores(q, k, G, m):
    C, sub = k.shape[-2], m.sub
    nb = C // sub
    Gb = G.unflatten(-2, (nb, sub))
    ref = Gb[..., :1, :]
    qk = torch.stack([q.unflatten(-2, (nb, sub)), k.unflatten(-2, (nb, sub))], dim=-1)
    rows = (qk * (Gb - ref).exp().unsqueeze(-1)).transpose(-1, -2).flatten(-3, -2)
    col = (ref - G.unsqueeze(-3)).masked_fill(~m.before[..., None], float("-inf")).exp() * k.unsqueeze(-3)
    A = (rows @ col.transpose(-1, -2)).unflatten(-2, (sub, 2))
    diff = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(~m.causal[..., None], float("-inf"))
    D = (diff.exp() * k.unflatten(-2, (nb, sub)).unsqueeze(-3)) @ qk
    A = A.unflatten(-1, (nb, sub))
    A.diagonal(0, -5, -2).add_(D.movedim(-4, -1).transpose(-3, -2))
    A = A.flatten(-2).flatten(-4, -3)
    return A[..., 0, :], A[..., 1, :]


# ---- END BASELINE ------------------------------------------------------------------------------------


def load_fla_naive() -> Callable | None:
    """fla's naive_chunk_kda, loaded by file path: ``from fla.ops.kda.naive import naive_chunk_kda``
    imports fla.ops, which needs triton (absent on this CPU setup)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    if not path.exists():
        return None
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.naive_chunk_kda


def make_inputs(B: int, T: int, gate: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Model-like float32 inputs: normalised q (scaled) and k, K3 (bounded) or Kimi Linear gates."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, K, generator=gen)) * K**-0.5
    k = l2_normalize(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    z = torch.randn(B, T, H, K, generator=gen)
    a_log = torch.randn(H, 1, generator=gen) * 0.5
    dt_bias = torch.randn(H * K, generator=gen) - 2.0
    g = kda_gate(z, a_log, dt_bias, -5.0 if gate == "k3" else None)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    state = torch.zeros(B, H, K, V)
    return q, k, v, g, beta, state


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """Best wall time in ms of ``repeat`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def gemm_gflops(C: int, n: int, repeat: int) -> float:
    """Rate of the batched [C, K] @ [K, V] matmuls that dominate the kernel, in GFLOP/s."""
    a, b = torch.randn(n, C, K), torch.randn(n, K, V)
    ms = best_of(lambda: a @ b, repeat)
    return 2 * n * C * K * V / ms / 1e6


def kernel_flops(B: int, T: int, C: int) -> float:
    """Matmul FLOPs of the chunked form per call (lower-triangular products counted half)."""
    n = -(-T // C)
    per_chunk = (
        2 * C * C * K  # q and k scores, lower triangle
        + C * C * (K + V)  # T @ [k | v] with the lower-triangular inverse T
        + 3 * 2 * C * K * V  # W S, (q exp G) S, (k decay)^T V'
        + C * C * V  # A_qk V', lower triangle
    )
    return B * H * n * per_chunk


def time_shape(B: int, T: int, args: argparse.Namespace, naive: Callable | None) -> str:
    """One row of the table: the three kernels on one shape, interleaved against machine noise."""
    inputs = make_inputs(B, T, args.gate)
    C = args.chunk or CHUNK
    new = partial(kda_chunked, *inputs, chunk_size=C)
    old = partial(baseline_kda_chunked, *inputs)
    (o_new, s_new), (o_old, s_old) = new(), old()
    diff = max((o_new - o_old).abs().max().item(), (s_new - s_old).abs().max().item())
    t_new = t_old = float("inf")
    for _ in range(2):
        t_new = min(t_new, best_of(new, args.repeat))
        t_old = min(t_old, best_of(old, args.repeat))
    t_fla = float("nan")
    if naive is not None and T % 64 == 0:  # naive_chunk_kda takes whole chunks of 64 only
        t_fla = best_of(partial(naive, *inputs[:5], scale=1.0, initial_state=inputs[5], output_final_state=True), 2)
    rate = gemm_gflops(C, B * H * -(-T // C), args.repeat)
    bound = kernel_flops(B, T, C) / rate / 1e6
    return (
        f"{B:>3} {T:>4} | {t_new:8.2f} {t_old:8.2f} {t_fla:8.2f} | {t_old / t_new:7.2f}x {t_fla / t_new:7.1f}x"
        f" | {bound:7.2f} ms at {rate:3.0f} GFLOP/s | {diff:8.1e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--gate", choices=["k3", "linear"], default="k3")
    ap.add_argument("--chunk", type=int, default=None, help=f"chunk size of tidal's kernel (default {CHUNK})")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    naive = load_fla_naive()
    print(f"threads={args.threads} gate={args.gate} H={H} K=V={K} float32, best of {args.repeat};"
          f" tidal chunk={args.chunk or CHUNK}, baseline chunk=64")
    print("  B    T |    tidal baseline fla-naive | old/new fla/new | FLOP-bound estimate         | max|new-old|")
    for B, T in SHAPES:
        print(time_shape(B, T, args, naive))


if __name__ == "__main__":
    main()
