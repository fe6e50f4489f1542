"""Kimi Delta Attention kernels (spec §1.2-§1.5): gate, q/k normalisation, recurrent and chunked forms.

Per head the state S [K, V] evolves token by token as
    S <- Diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T q_t.
Both kernels start from and return that state and compute in the state's dtype (float32, or
float64 in float64 runs); layouts follow flash-linear-attention: q, k, g [B, T, H, K], v [B, T, H, V],
beta [B, T, H], state [B, H, K, V]. q is expected L2-normalised and scaled, k L2-normalised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.model.layers import compute_dtype

L2_EPS = 1e-6
SUB_BLOCK = 8  # diagonal block size inside a chunk (see _decayed_scores)


def kda_gate(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Log-decay g [..., H, K] from the raw gate input z [..., H, K], in float32 (or float64).

    A_log broadcasts against [H, K] ([H, 1] per head or [1, K] per channel); dt_bias has H*K
    entries indexed h*K + d. Without a lower bound (Kimi Linear) g = -exp(A_log) softplus(z + dt_bias);
    with one (K3) g = lb * sigmoid(exp(A_log) (z + dt_bias)), which keeps g in (lb, 0)."""
    H, K = z.shape[-2:]
    cdt = compute_dtype(z.dtype)
    x = z.to(cdt) + dt_bias.to(cdt).view(H, K)
    a = A_log.to(cdt).exp()
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (eps inside the sqrt of the SUM, as fla/vLLM)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token reference (and the batched decode kernel when T == 1).

    Returns o [B, T, H, V] in v's dtype and the new state in state's dtype."""
    dt, out_dtype = state.dtype, v.dtype
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    decay = g.exp()
    S = state
    outs = []
    for t in range(q.shape[1]):
        S = S * decay[:, t].unsqueeze(-1)
        kt = k[:, t].unsqueeze(-2)  # [B, H, 1, K]
        r = (v[:, t].unsqueeze(-2) - kt @ S) * beta[:, t, :, None, None]  # [B, H, 1, V]
        S = S + kt.transpose(-1, -2) @ r
        outs.append(q[:, t].unsqueeze(-2) @ S)
    if not outs:
        return v.to(out_dtype), state
    return torch.cat(outs, dim=-2).transpose(1, 2).to(out_dtype), S


def kda_decode_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One decode token per sequence, updating ``state`` [B, H, K, V] IN PLACE: the fast form of
    :func:`kda_recurrent` at T == 1 (three passes over the state instead of five, no copies).

    q, k, g [B, H, K], v [B, H, V], beta [B, H]; returns o [B, H, V] in v's dtype."""
    dt = state.dtype
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    state.mul_(g.exp().unsqueeze(-1))
    r = (v.unsqueeze(-2) - k.unsqueeze(-2) @ state) * beta[..., None, None]  # [B, H, 1, V]
    state.addcmul_(k.unsqueeze(-1), r)  # + k r^T, the outer product broadcast
    return (q.unsqueeze(-2) @ state).squeeze(-2).to(v.dtype)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked WY/UT form (spec §1.5) for prefill: any T, the last chunk zero-padded internally.

    Padding tokens have g = 0 and k = v = beta = 0, so they neither decay nor write the state.
    Per chunk (cumulative in-chunk log decay G):
      M = strict-lower beta_r sum_d k_r k_s exp(G_r - G_s);   (I + M) [W | U] = beta [exp(G) k | v]
      V' = U - W S;   O = (q exp(G)) S + A_qk V';   S <- exp(G_C) S + (exp(G_C - G) k)^T V'.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = state.dtype
    C = chunk_size
    n = -(-T // C)
    pad = n * C - T
    q, k, v, g = (F.pad(t.to(dt).transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v, g))  # [B, H, nC, *]
    beta = F.pad(beta.to(dt).transpose(1, 2), (0, pad))  # [B, H, nC]
    sub = SUB_BLOCK if C % SUB_BLOCK == 0 else C
    masks = _ScoreMasks(C, sub, q.device)
    S = state.to(dt)
    o = torch.empty(B, H, n * C, V, dtype=dt, device=q.device)
    for i in range(n):
        sl = slice(i * C, (i + 1) * C)
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl, None]
        G = g[:, :, sl].cumsum(-2)
        a_qk, a_kk = _decayed_scores(qc, kc, G, masks)
        eG = G.exp()
        rhs = bc * torch.cat([eG * kc, vc], dim=-1)
        # unitriangular: the solver reads only the strict lower part of M and takes I on the diagonal.
        wu = torch.linalg.solve_triangular(bc * a_kk, rhs, upper=False, unitriangular=True)
        w, u = wu.split([K, V], dim=-1)
        v_new = u - w @ S
        o[:, :, sl] = (qc * eG) @ S + a_qk @ v_new
        g_last = G[:, :, -1:]  # [B, H, 1, K]
        S = S * g_last.transpose(-1, -2).exp() + ((g_last - G).exp() * kc).transpose(-1, -2) @ v_new
    return o[:, :, :T].transpose(1, 2).to(v.dtype), S.to(state.dtype)


class _ScoreMasks:
    """Boolean masks for one chunk of C tokens split into C // sub diagonal blocks."""

    def __init__(self, C: int, sub: int, device: torch.device) -> None:
        nb = C // sub
        self.sub = sub
        s = torch.arange(C, device=device)
        # before[I, s]: column s lies in a block strictly before row block I.
        self.before = s[None, :] < (torch.arange(nb, device=device) * sub)[:, None]  # [nb, C]
        j = torch.arange(sub, device=device)
        self.causal = j[None, :] <= j[:, None]  # [sub, sub], s <= r


def _decayed_scores(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, m: _ScoreMasks
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_qk, A_kk) [..., C, C] with A_xk[r, s] = sum_d x_r[d] k_s[d] exp(G_r[d] - G_s[d]) for s <= r, 0 above.

    Only differences G_r - G_s with s <= r are exponentiated (each factor <= 1), so no decay can
    overflow. Off-diagonal blocks split the decay at the first token n of the row block I:
    exp(G_r - G_n) * exp(G_n - G_s), both <= 1, which turns them into one matmul. Diagonal
    blocks are formed pairwise. q and k rows share every decay factor, so they go through together."""
    C, sub = k.shape[-2], m.sub
    nb = C // sub
    Gb = G.unflatten(-2, (nb, sub))  # [..., nb, sub, K]
    ref = Gb[..., :1, :]  # [..., nb, 1, K]
    qk = torch.stack([q.unflatten(-2, (nb, sub)), k.unflatten(-2, (nb, sub))], dim=-1)  # [..., nb, sub, K, 2]
    # off-diagonal blocks: [..., nb, 2*sub, K] @ [..., nb, K, C]
    rows = (qk * (Gb - ref).exp().unsqueeze(-1)).transpose(-1, -2).flatten(-3, -2)
    col = (ref - G.unsqueeze(-3)).masked_fill(~m.before[..., None], float("-inf")).exp() * k.unsqueeze(-3)
    A = (rows @ col.transpose(-1, -2)).unflatten(-2, (sub, 2))  # [..., nb, sub, 2, C]
    # diagonal blocks: [..., nb, r, s, K] @ [..., nb, r, K, 2]
    diff = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(~m.causal[..., None], float("-inf"))
    D = (diff.exp() * k.unflatten(-2, (nb, sub)).unsqueeze(-3)) @ qk  # [..., nb, r, s, 2]
    A = A.unflatten(-1, (nb, sub))  # [..., I, r, 2, J, s]
    A.diagonal(0, -5, -2).add_(D.movedim(-4, -1).transpose(-3, -2))
    A = A.flatten(-2).flatten(-4, -3)  # [..., C, 2, C]
    return A[..., 0, :], A[..., 1, :]
