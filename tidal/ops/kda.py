"""Kimi Delta Attention kernels (spec §1.2-§1.5): gate, q/k normalisation, recurrent and chunked forms.

Per head the state S [K, V] evolves token by token as
    S <- Diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T q_t.
Both kernels start from and return that state and compute in the state's dtype (float32, or
float64 in float64 runs); layouts follow flash-linear-attention: q, k, g [B, T, H, K], v [B, T, H, V],
beta [B, T, H], state [B, H, K, V]. q is expected L2-normalised and scaled, k L2-normalised.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tidal.model.layers import compute_dtype
from tidal.ops.cpu_kernels import kda_decode_for

L2_EPS = 1e-6
CHUNK = 32  # tokens per chunk of kda_chunked: on CPU as fast as 16, faster than 64
TILE_TOKENS = 4096  # tokens per tile of the within-chunk work without autograd (see _intra_chunk)


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
    use_kernel: bool = True,
) -> torch.Tensor:
    """One decode token per sequence, updating ``state`` [B, H, K, V] IN PLACE (it may be a
    strided view of the engine's pool): the fast form of :func:`kda_recurrent` at T == 1.

    Decode is bound by passes over the state: both reads of the decayed state come from ONE matmul
    on the old state ((D S)^T x = S^T (D x)), then two in-place passes update it -- three passes
    instead of five, and no copies. q, k, g [B, H, K], v [B, H, V], beta [B, H]; returns o [B, H, V]
    in v's dtype. On the CPU a C kernel (``tidal.ops.cpu_kernels``) does the same in one pass over
    the state unless ``use_kernel=False``."""
    kernel = kda_decode_for(state, q, k, v, g, beta) if use_kernel else None
    if kernel is not None:
        return kernel(q, k, v, g, beta, state).to(v.dtype)
    dt = state.dtype
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    decay = g.exp()
    read = _state_matmul(torch.stack([k * decay, q * decay], dim=-2), state)  # [B, H, 2, V]
    r = (v - read[..., 0, :]) * beta.unsqueeze(-1)  # [B, H, V]
    o = read[..., 1, :] + r * (k * q).sum(-1, keepdim=True)  # (D S + k r^T)^T q
    state.mul_(decay.unsqueeze(-1))
    state.addcmul_(k.unsqueeze(-1), r.unsqueeze(-2))  # + k r^T, the outer product broadcast
    return o.to(v.dtype)


def _state_matmul(a: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """a [B, H, m, K] @ state [B, H, K, V] without copying the state: a view of consecutive pool
    blocks cannot merge its B and H dims (matmul would copy it), so it runs one bmm per head."""
    B, H = state.shape[:2]
    if B == 1 or H == 1 or state.stride(0) == H * state.stride(1):
        return a @ state
    return torch.stack([torch.bmm(a[:, h], state[:, h]) for h in range(H)], dim=1)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked WY/UT form (spec §1.5) for prefill: any T, the last chunk zero-padded internally.

    Per chunk (cumulative in-chunk log decay G):
      M = strict-lower beta_r sum_d k_r k_s exp(G_r - G_s);   (I + M) [W | U] = beta [exp(G) k | v]
      V' = U - W S;   O = (q exp(G)) S + A_qk V';   S <- exp(G_C) S + (exp(G_C - G) k)^T V'.
    Everything inside the chunks is computed for all sequences, heads and chunks at once
    (:func:`_intra_chunk`); only the state pass runs chunk by chunk. Padding tokens have g = 0 and
    k = v = beta = 0: they neither decay nor write the state, so appending such tokens to a sequence
    changes no bit of its result, and each sequence of a batch gets the arithmetic it gets alone.
    Differentiable (training uses it); without autograd it updates its own buffers in place."""
    B, T, H, K = q.shape
    V, out_dtype, dt = v.shape[-1], v.dtype, state.dtype
    n = -(-T // chunk_size)
    inplace = not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, state)))
    q, k, v, g = (_to_chunks(t.to(dt), n, chunk_size) for t in (q, k, v, g))
    beta = _to_chunks(beta.to(dt).unsqueeze(-1), n, chunk_size)
    chunks = _intra_chunk(q, k, v, g, beta, inplace)
    o, S = _across_chunks(chunks, state.to(dt).reshape(B * H, K, V), B, inplace)
    return o[:, :T].to(out_dtype), S.view(B, H, K, V).to(state.dtype)


def _to_chunks(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """[B, T, H, D] -> [B*H*n, C, D], one (sequence, head, chunk) per row, zero-padded to n*C
    tokens: a single copy into a fresh buffer (which the in-place path may then overwrite)."""
    B, T, H, D = x.shape
    out = x.new_empty(B, H, n * C, D)
    out[:, :, T:].zero_()
    out[:, :, :T] = x.transpose(1, 2)
    return out.view(B * H * n, C, D)


class _Chunks(NamedTuple):
    """What the state pass needs of each chunk, [N, C, *] with N = B*H*n rows (sequence, head, chunk)."""

    a_qk: torch.Tensor  # [N, C, C] sum_d q_r k_s exp(G_r - G_s) for s <= r, 0 above
    w: torch.Tensor  # [N, C, K] W = (I + M)^-1 beta exp(G) k
    u: torch.Tensor  # [N, C, V] U = (I + M)^-1 beta v
    q_in: torch.Tensor  # [N, C, K] q exp(G): decayed from the chunk's start in to each token
    k_out: torch.Tensor  # [N, C, K] k exp(G_C - G): decayed from each token out to the chunk's end
    decay: torch.Tensor  # [N, 1, K] exp(G_C)


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, inplace: bool
) -> _Chunks:
    """All chunks of the call. Without autograd they go in tiles of about TILE_TOKENS tokens, so
    that each tile's temporaries stay in cache (measured 8-14% faster on large calls); a chunk's
    arithmetic does not depend on its tile."""
    N, C, K = q.shape
    tile = max(1, TILE_TOKENS // C)
    if not inplace or N <= tile:
        return _intra_tile(q, k, v, g, beta, inplace)
    out = _Chunks(q.new_empty(N, C, C), q.new_empty(N, C, K), v.new_empty(v.shape), q.new_empty(N, C, K),
                  k, q.new_empty(N, 1, K))  # k_out is k, scaled in place
    for lo in range(0, N, tile):
        rows = slice(lo, lo + tile)
        _intra_tile(q[rows], k[rows], v[rows], g[rows], beta[rows], True, _Chunks(*(t[rows] for t in out)))
    return out


def _intra_tile(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    inplace: bool,
    out: _Chunks | None = None,
) -> _Chunks:
    """Scores, (I + M)^-1 and the decayed q and k of each chunk, without one exp(G_r - G_s).

    A chunk is merged bottom-up from blocks (of 1 token, or of C's odd factor): merging sibling
    blocks L, R that meet at token m fills the scores of R's rows against L's columns with ONE
    matmul, (x_r exp(G_r - G_m)) . (k_s exp(G_m - G_s)), where both factors are <= 1 whatever the
    decay. Each block carries its rows decayed from its start, its columns decayed to its end and
    its total decay; a merge only multiplies those by the sibling's total decay, so a chunk costs
    one exp(g) per element and a few multiplies per level, and no exponent is ever positive.
    Writes into ``out`` (without autograd) when given."""
    N, C, _ = q.shape
    base = C // (C & -C)  # odd part of C: the block size the doubling starts from
    blocks = _unit_blocks(q, k, g, inplace) if base == 1 else _dense_blocks(q, k, g, beta, base, inplace)
    neg_beta = -beta.view(N, C)
    b = base
    while b < C:
        blocks = _merge_siblings(blocks, neg_beta, b, inplace)
        b *= 2
    q_in, k_in = blocks.rows.unbind(-2)  # rows decayed from the chunk's start
    inv_beta = blocks.inv.view(N, C, C) * beta.transpose(-1, -2)  # (I + M)^-1 diag(beta)
    if out is None:
        return _Chunks(blocks.a_qk, inv_beta @ k_in, inv_beta @ v, q_in, blocks.cols, blocks.decay)
    torch.matmul(inv_beta, k_in, out=out.w)
    torch.matmul(inv_beta, v, out=out.u)
    for dst, src in ((out.a_qk, blocks.a_qk), (out.q_in, q_in), (out.decay, blocks.decay)):
        dst.copy_(src)
    return out


class _Blocks(NamedTuple):
    """A chunk split into blocks of b tokens, each solved on its own (N rows, C tokens)."""

    rows: torch.Tensor  # [N, C, 2, K] (q_r, k_r) exp(G_r - G_start): decayed from block start to r
    cols: torch.Tensor  # [N, C, K] k_s exp(G_end - G_s): decayed from s (excluded) to block end
    decay: torch.Tensor  # [N, C/b, K] exp(G_end - G_start) of each block
    a_qk: torch.Tensor  # [N, C, C] A_qk with the diagonal blocks done (filled in place)
    inv: torch.Tensor  # [N, C/b, b, b] (I + M)^-1 of each diagonal block


def _unit_blocks(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, inplace: bool) -> _Blocks:
    """Blocks of one token: decay exp(g), A_qk diagonal q.k, inverse 1. ``k`` becomes the columns,
    scaled in place later when ``inplace`` (it is kda_chunked's own copy)."""
    N, C, K = q.shape
    e = g.exp()
    rows = torch.cat([q, k], dim=-1).view(N, C, 2, K)
    rows = rows.mul_(e.unsqueeze(-2)) if inplace else rows * e.unsqueeze(-2)
    a_qk = q.new_zeros(N, C, C)
    a_qk.diagonal(0, -2, -1).copy_(torch.linalg.vecdot(q, k))
    return _Blocks(rows, k, e, a_qk, q.new_ones(N, C, 1, 1))


def _dense_blocks(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, b: int, inplace: bool
) -> _Blocks:
    """Blocks of b tokens (b odd: chunk sizes that are no power of two) formed pairwise, with
    exp(G_r - G_s) for every s <= r of a block and -inf above the diagonal. Like _unit_blocks it
    returns the columns in k's buffer when ``inplace``."""
    N, C, K = q.shape
    nb = C // b
    G = g.view(N, nb, b, K).cumsum(2)  # log decay from the block's start, <= 0
    lower = torch.ones(b, b, dtype=torch.bool, device=q.device).tril()
    pair = (G.unsqueeze(3) - G.unsqueeze(2)).masked_fill(~lower[..., None], float("-inf")).exp()  # [N, nb, r, s, K]
    k_pair = pair * k.view(N, nb, 1, b, K)
    a_qk = q.new_zeros(N, C, C)
    a_qk.view(N, nb, b, nb, b).diagonal(0, 1, 3).copy_((k_pair * q.view(N, nb, b, 1, K)).sum(-1).permute(0, 2, 3, 1))
    m = (k_pair * k.view(N, nb, b, 1, K)).sum(-1) * beta.view(N, nb, b, 1)  # its diagonal is ignored
    eye = torch.eye(b, dtype=q.dtype, device=q.device).expand_as(m)
    inv = torch.linalg.solve_triangular(m, eye, upper=False, unitriangular=True)
    end = G[:, :, -1:]
    rows = torch.cat([q, k], dim=-1).view(N, nb, b, 2, K) * G.exp().unsqueeze(-2)
    cols = k.view(N, nb, b, K)
    cols = cols.mul_((end - G).exp()) if inplace else cols * (end - G).exp()
    return _Blocks(rows.view(N, C, 2, K), cols.view(N, C, K), end.exp().view(N, nb, K), a_qk, inv)


def _merge_siblings(blocks: _Blocks, neg_beta: torch.Tensor, b: int, inplace: bool) -> _Blocks:
    """Blocks of b tokens -> blocks of 2b: the scores of the right sibling's rows against the
    left's columns, the off-diagonal block of the inverse, and rows / columns rescaled to the new
    block's start / end. neg_beta is -beta [N, C]."""
    rows, cols, decay, a_qk, inv = blocks
    N, C, _, K = rows.shape
    n2 = C // (2 * b)
    r = rows.view(N, n2, 2, b, 2, K)  # [row, parent, sibling, token, q|k, K]
    c = cols.view(N, n2, 2, b, K)
    d = decay.view(N, n2, 2, K)
    scores = (r[:, :, 1].flatten(2, 3) @ c[:, :, 0].transpose(-1, -2)).view(N, n2, b, 2, b)
    a_qk.view(N, n2, 2, b, n2, 2, b).diagonal(0, 1, 4)[:, 1, :, 0].copy_(scores[:, :, :, 0].permute(0, 2, 3, 1))
    m21 = scores[:, :, :, 1] * neg_beta.view(N, n2, 2, b, 1)[:, :, 1]  # -M (right rows, left columns)
    t = inv.view(N, n2, 2, b, b)
    t1, t2 = t[:, :, 0], t[:, :, 1]
    x21 = m21 if b == 1 else t2 @ m21 @ t1  # [[T1, 0], [M21, T2]]^-1 = [[T1, 0], [-T2 M21 T1, T2]]
    inv = torch.cat([torch.cat([t1, torch.zeros_like(t1)], -1), torch.cat([x21, t2], -1)], -2)
    rows = _scale_sibling(r, 1, d[:, :, 0, None, None], inplace)  # right rows: from the left's start
    cols = _scale_sibling(c, 0, d[:, :, 1, None], inplace)  # left columns: to the right's end
    return _Blocks(rows.view(N, C, 2, K), cols.view(N, C, K), d[:, :, 0] * d[:, :, 1], a_qk, inv)


def _scale_sibling(x: torch.Tensor, sibling: int, f: torch.Tensor, inplace: bool) -> torch.Tensor:
    """x [N, n2, 2, ...] with one sibling multiplied by f [N, n2, ...]: in place, or (for autograd)
    as a product with [f, 1] or [1, f], which gives the same bits."""
    if inplace:
        x[:, :, sibling].mul_(f)
        return x
    one = torch.ones_like(f)
    return x * torch.stack([one, f] if sibling else [f, one], dim=2)


def _across_chunks(ch: _Chunks, S: torch.Tensor, B: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The state pass, chunk by chunk for all B*H rows at once. S [B*H, K, V] is read, not written.
    Returns o [B, n*C, H, V] and the final state [B*H, K, V]."""
    BH, _, V = S.shape
    N, C = ch.a_qk.shape[:2]
    n, H = N // BH, BH // B
    a_qk, w, u, q_in, k_out, decay = (t.view(BH, n, *t.shape[1:]) for t in ch)
    k_out, decay = k_out.transpose(-1, -2), decay.transpose(-1, -2)  # [BH, n, K, C], [BH, n, K, 1]
    o = S.new_empty(B, n, C, H, V)
    for i in range(n):
        v_new = torch.baddbmm(u[:, i], w[:, i], S, alpha=-1)  # V' = U - W S
        o_i = torch.bmm(a_qk[:, i], v_new).baddbmm_(q_in[:, i], S)  # in place on fresh tensors only
        o[:, i] = o_i.view(B, H, C, V).transpose(1, 2)
        S = S.mul_(decay[:, i]) if inplace and i > 0 else S * decay[:, i]  # S is ours from chunk 1 on
        S = S.baddbmm_(k_out[:, i], v_new)
    return o.view(B, n * C, H, V), S
