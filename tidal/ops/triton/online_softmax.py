"""The online-softmax step both attention kernels share (flash attention's running max and sum)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_tile(m, l_sum, acc, scores, values, DOT: tl.constexpr):
    """Fold a tile of scores [M, N] (-inf where masked) and its values [N, D] into the running max
    m [M], sum l_sum [M] and unnormalised output acc [M, D]."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    alpha = tl.exp(m - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), values, input_precision="ieee")
    return m_new, l_sum, acc


@triton.jit
def softmax_finish(m, l_sum, acc):
    """(normalised output, log-sum-exp); a row that saw no key gets 0 and -inf."""
    seen = l_sum > 0
    safe = tl.where(seen, l_sum, 1.0)
    return acc / safe[:, None], tl.where(seen, m + tl.log(safe), float("-inf"))
