"""The DSPARK drafter's slot loop behind one seam: a block's drafts left to right, each slot's LM
head logits plus the Markov head's bias from the draft before it, the argmax and its probability,
until the block's size or until its chance of being reached falls below the cut.

In torch that is a dozen small calls per slot (the bias product, max, logsumexp, index writes),
whose dispatch costs more than their vocabulary-wide arithmetic at a few blocks; on the CPU the C
kernel (``csrc/markov_draft.c``) runs the whole loop in one call. :func:`draft_slots_reference` is
the same loop in float64, which tests compare it with.
"""

from __future__ import annotations

import torch

from tidal.ops.cpu_kernels import markov_draft_kernel


def draft_slots(head: torch.Tensor, markov_in: torch.Tensor | None, markov_out: torch.Tensor | None,
                prev: torch.Tensor, wanted: torch.Tensor, min_reach: float
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """head [B, S, V] float32 (each slot's LM head logits), the Markov head's ``markov_in`` [V, r]
    and ``markov_out`` [V, r] stored input-major (``markov_out.t()`` contiguous; None, None: no
    Markov head), prev [B] (each block's anchor token), wanted [B] (drafts per block), the reach
    cut -> (drafted [B, S] int64, -1 past a block's last draft; confidence [B, S] float32, 0 there);
    None where the kernel does not apply (another device or dtype, a weight laid out otherwise,
    no C compiler): the caller runs its torch loop."""
    fn = markov_draft_kernel()
    if fn is None or not head.is_cpu or head.dtype != torch.float32 or head.dim() != 3:
        return None
    B, S, V = head.shape
    if markov_in is None or markov_out is None:
        r, m_in, m_out_t = 0, head, head
    else:
        r, m_in, m_out_t = markov_in.shape[1], markov_in, markov_out.t()
        if (markov_in.dtype != torch.float32 or m_out_t.dtype != torch.float32 or not markov_in.is_contiguous()
                or not m_out_t.is_contiguous() or markov_in.shape[0] != V or m_out_t.shape != (r, V)):
            return None
    head = head.contiguous()
    prev = prev.to(torch.int64).contiguous()
    wanted = wanted.to(torch.int64).contiguous()
    drafted = torch.empty(B, S, dtype=torch.int64)
    confidence = torch.empty(B, S, dtype=torch.float32)
    if fn(head.data_ptr(), B, S, V, m_in.data_ptr(), m_out_t.data_ptr(), r, prev.data_ptr(), wanted.data_ptr(),
          float(min_reach), drafted.data_ptr(), confidence.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError(f"markov_draft: no scratch memory for a vocabulary of {V}")
    return drafted, confidence


def draft_slots_reference(head: torch.Tensor, markov_in: torch.Tensor | None, markov_out: torch.Tensor | None,
                          prev: torch.Tensor, wanted: torch.Tensor, min_reach: float
                          ) -> tuple[list[list[int]], list[list[float]]]:
    """:func:`draft_slots` in float64, one block and slot at a time: (drafts, confidences) per block."""
    tokens, confs = [], []
    for b in range(head.shape[0]):
        p, reach, got, conf = int(prev[b]), 1.0, [], []
        for j in range(min(head.shape[1], int(wanted[b]))):
            logits = head[b, j].double()
            if markov_in is not None:
                logits = logits + markov_out.double() @ markov_in[p].double()
            p = int(logits.argmax())
            c = float(logits.softmax(dim=-1)[p])
            got.append(p)
            conf.append(c)
            reach *= c
            if min_reach > 0.0 and reach < min_reach * (1 - 1e-3):
                break
        tokens.append(got)
        confs.append(conf)
    return tokens, confs
