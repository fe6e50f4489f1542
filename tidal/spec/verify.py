"""Verify numerics: a request's drafted chain runs through the target with the DECODE kernels.

A chain of m tokens (the last committed token, then the drafts) is m decode steps folded into one
forward: every layer takes chain position j of all chains as one batch of single-token decodes,
j = 0 .. m-1. The KDA conv window and recurrent state of position j are the decode kernel's
output from position j-1; the MLA query of position j attends, weight-absorbed, over the pages up
to and including position j. Each position's logits are therefore the ones plain decode would
produce after accepting the chain up to there, bit for bit (the decode kernels are row-wise).

Where the states go depends on the rollback method (``tidal.spec.rollback``):

- "swap": position j reads the state block of position j-1 and writes its own (position 0 updates
  the request's block in place); the commit keeps the accepted position's block.
- "replay": the request's block is the checkpoint and is left alone; positions step a transient
  copy, and each position's kernel inputs are stored in the request's replay window, from which
  the commit replays the accepted positions into the checkpoint with the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal.ops import fused_decode
from tidal.ops.kda import kda_decode_step_
from tidal.ops.backends import mla_paged_decode
from tidal.ops.short_conv import causal_conv_step


@dataclass
class VerifyLayout:
    """The chains of one step. ``seqs``: their batch positions (query_lens[b] = chain length);
    ``slots[b]``: the state slot of each chain position ("swap"); ``window``: the replay window
    ("replay")."""

    seqs: list[int]
    method: str
    slots: dict[int, list[int]] = field(default_factory=dict)
    window: "ReplayWindow | None" = None
    _work: dict[tuple[str, object], object] = field(default_factory=dict, repr=False)
    _index: dict[tuple[int, str], "PositionIndex"] = field(default_factory=dict, repr=False)

    def positions(self, batch, j: int, device: torch.device) -> "PositionIndex":
        """Chain position j's index tensors, built once per step (every layer reuses them)."""
        key = (j, str(device))
        if key not in self._index:
            live = [(b, i) for i, b in enumerate(self.seqs) if batch.query_lens[b] > j]
            seqs = [b for b, _ in live]

            def index(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.long, device=device)

            self._index[key] = PositionIndex(
                seqs=seqs,
                rows=index([batch.cu_seqlens[b] + j for b in seqs]),
                live=index([i for _, i in live]),
                src=index([self.slots[b][max(j - 1, 0)] for b in seqs]) if self.method == "swap" else None,
                dst=index([self.slots[b][j] for b in seqs]) if self.method == "swap" else None,
                start=index([batch.cache.state_slots[b] for b in self.seqs]),
            )
        return self._index[key]

    def chain_groups(self, batch, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(rows, slots, src, groups) of :func:`tidal.ops.fused_decode.kda_layer_chain` for the
        step's decodes (a group each) and chains ("swap": position j in ``slots[b][j]``, copied
        from position j-1's block), built once per step."""
        key = ("chain groups", str(device))
        if key not in self._work:
            rows, slots, src, groups = [], [], [], [0]
            for b in batch.decode_seqs:
                rows.append(batch.cu_seqlens[b])
                slots.append(batch.cache.state_slots[b])
                src.append(-1)
                groups.append(len(rows))
            for b in self.seqs:
                blocks = self.slots[b]
                for j in range(batch.query_lens[b]):
                    rows.append(batch.cu_seqlens[b] + j)
                    slots.append(blocks[j])
                    src.append(blocks[j - 1] if j else -1)
                groups.append(len(rows))
            self._work[key] = tuple(torch.tensor(x, dtype=dt, device=device) for x, dt in
                                    ((rows, torch.int64), (slots, torch.int32), (src, torch.int32), (groups, torch.int64)))
        return self._work[key]  # type: ignore[return-value]


@dataclass
class PositionIndex:
    """Chain position j of one step: the chains that have it (batch positions), their rows in the
    flat token run, their indexes among all chains, and the state slots read (src) and written
    (dst) by the swap method; ``start``: every chain's own slot."""

    seqs: list[int]
    rows: torch.Tensor
    live: torch.Tensor
    src: torch.Tensor | None
    dst: torch.Tensor | None
    start: torch.Tensor


def _step(batch, storage: torch.Tensor, kind: str, layer: int, j: int, pos: PositionIndex, kernel) -> torch.Tensor:
    """Run ``kernel(state) -> output`` (updating ``state`` in place) on chain position j, reading
    and writing the states where the layout's method keeps them."""
    v: VerifyLayout = batch.verify
    if v.method == "swap":
        state = storage[pos.src]
        out = kernel(state)
        storage[pos.dst] = state
        return out
    key = (kind, layer)
    if j == 0:  # a transient copy of every chain's checkpoint
        v._work[key] = storage[pos.start]
    work = v._work[key]
    state = work[pos.live]
    out = kernel(state)
    work[pos.live] = state
    return out


def verify_kda_fused(qkv: torch.Tensor, z: torch.Tensor, gate: torch.Tensor, b: torch.Tensor,
                     conv_state: torch.Tensor, rec_state: torch.Tensor, batch, **kernel_args) -> torch.Tensor | None:
    """A decode-and-chains step of a KDA layer ("swap" rollback, no prefill) in one call of the
    fused decode kernel's chain form (``tidal.ops.fused_decode.kda_layer_chain``, the per-row code
    a pure decode step runs): each decode on its own slot, each chain's positions in order,
    position 0 on its block in place and position j on its block after a copy of the block of
    position j-1. Returns the gated o [T, P] of every row, or None (nothing changed) where the
    kernel does not apply."""
    rows, slots, src, groups = batch.verify.chain_groups(batch, qkv.device)
    return fused_decode.kda_layer_chain(qkv, z, gate, b, conv_state, rec_state, rows, slots, src, groups,
                                        **kernel_args)


def verify_conv(qkv: torch.Tensor, weight: torch.Tensor, storage: torch.Tensor, batch, layer: int,
                out: torch.Tensor) -> None:
    """The chains' short conv + SiLU, position by position (``causal_conv_step``); writes their
    rows of ``out``."""
    v: VerifyLayout = batch.verify
    for j in range(max(batch.query_lens[b] for b in v.seqs)):
        pos = v.positions(batch, j, qkv.device)
        x = qkv[pos.rows]

        def conv(state: torch.Tensor) -> torch.Tensor:
            y, new = causal_conv_step(x, weight, state)
            state.copy_(new)
            return y

        out[pos.rows] = _step(batch, storage, "conv", layer, j, pos, conv)
        if v.window is not None:
            v.window.store(layer, pos.seqs, j, {"qkv": x})


def verify_delta(inputs: tuple[torch.Tensor, ...], storage: torch.Tensor, batch, layer: int,
                 o: torch.Tensor) -> None:
    """The chains' KDA recurrence, position by position (``kda_decode_step_``); writes their rows
    of ``o``."""
    v: VerifyLayout = batch.verify
    for j in range(max(batch.query_lens[b] for b in v.seqs)):
        pos = v.positions(batch, j, storage.device)
        q, k, vv, g, beta = (t[pos.rows] for t in inputs)
        o[pos.rows] = _step(batch, storage, "rec", layer, j, pos,
                            lambda state: kda_decode_step_(q, k, vv, g, beta, state)).to(o.dtype)
        if v.window is not None:
            v.window.store(layer, pos.seqs, j, {"q": q, "k": k, "v": vv, "g": g, "beta": beta})


def verify_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, batch, mla_layer: int, kv_b_weight: torch.Tensor,
               scale: float, out: torch.Tensor) -> None:
    """Every chain position as one decode query over the pages (its latents are written already),
    attending up to and including itself; writes the chains' rows of ``out``."""
    v: VerifyLayout = batch.verify
    paged = getattr(batch.cache, "mla_pages", None)
    if paged is None:
        raise ValueError("speculative verify needs the engine's paged cache")
    pages, table, _ = paged(mla_layer, v.seqs)
    rows, which, lengths = [], [], []
    for i, b in enumerate(v.seqs):
        for j in range(batch.query_lens[b]):
            rows.append(batch.cu_seqlens[b] + j)
            which.append(i)
            lengths.append(batch.cached_lens[b] + j + 1)
    dev = q_nope.device
    r = torch.tensor(rows, dtype=torch.long, device=dev)
    tab = table[torch.tensor(which, dtype=torch.long, device=table.device)]
    lens = torch.tensor(lengths, dtype=torch.long, device=table.device)
    out[r] = mla_paged_decode(q_nope[r], q_pe[r], pages, tab, lens, kv_b_weight, scale)
