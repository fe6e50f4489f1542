"""The tensor-parallel pieces around the unchanged model code.

A rank's model is the ordinary model built at its local widths (``tidal.parallel.shard``): heads and
intermediate widths divided by TP, so every projection reading the replicated hidden state is
column-parallel by construction, and every projection back to the hidden width (attention o_proj,
MLP down_proj, the routed experts' w2) yields a partial sum. One all-reduce per sub-layer completes
it: a forward hook on the sub-layer module, so model code and state_dict names do not change.
Embedding and lm_head split the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.model.layers import Embedding, Linear
from tidal.ops import dense
from tidal.parallel.groups import Collectives


def vocab_shard(vocab_size: int, tp_size: int, rank: int) -> tuple[int, int, int]:
    """(first row, rows stored = ceil(V / tp), rows that are real vocabulary) of this rank's shard;
    the last shard is zero-padded when tp does not divide V."""
    rows = -(-vocab_size // tp_size)
    first = rank * rows
    return first, rows, max(0, min(rows, vocab_size - first))


class VocabParallelEmbedding(Embedding):
    """This rank's rows of the embedding table; ids outside them contribute zeros, and the sum over
    ranks (one all-reduce) is the full lookup."""

    def __init__(self, vocab_size: int, dim: int, comm: Collectives) -> None:
        self.first, rows, self.real = vocab_shard(vocab_size, comm.place.tp_size, comm.place.rank)
        super().__init__(rows, dim)
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.real)
        h = F.embedding(local.masked_fill(~mine, 0), self.weight)
        return self.comm.all_reduce(h.masked_fill(~mine[..., None], 0))


class VocabParallelLMHead(Linear):
    """This rank's rows of lm_head; the logits of every rank are gathered (vocabulary order) and the
    padding of the last shard dropped, so every rank holds the full logits and samples the same.
    (tidal's Linear: on the meta device no random initialisation, see ``tidal.model.layers.Embedding``.)"""

    def __init__(self, dim: int, vocab_size: int, comm: Collectives) -> None:
        self.first, rows, self.real = vocab_shard(vocab_size, comm.place.tp_size, comm.place.rank)
        super().__init__(dim, rows, bias=False)
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(dense.linear(x, self.weight), dim=-1)[..., : self.vocab_size]


def all_reduce_output(module: nn.Module, comm: Collectives) -> None:
    """Sum ``module``'s output over the TP group (a forward hook: the module's code is unchanged)."""

    def hook(_m: nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(out)

    module.register_forward_hook(hook)
