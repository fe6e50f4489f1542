"""The DSPARK drafter's context cache: every draft layer's keys and values of each request's
committed context positions, each computed once.

The target hands positions over every step (their tapped hidden states). Several positions of a
request at once (a prefill chunk, a verified chain) get their keys and values at once; a plain
decode's single position only when the request next drafts (:meth:`DraftContextCache.pending`):
a step that does not speculate (the cost policy chose plain decoding) costs one copy of the
rows, and the context is complete whenever speculation resumes.

A request owns one of ``max_requests`` slots, allocated at start (their bytes are counted before
the pool is sized). A slot is a ring of ``window`` rows: position p lives in row p % window, and
``pos`` records which position a row holds (-1: none). The drafter attends to the positions
max(0, n-1-window) .. n-2 of a request with n tokens, which are ``window`` consecutive positions
and so occupy distinct rows. Rows holding other positions are masked out, so a row overwritten
by a recomputed position (a preempted request) or never written reads as absent. The drafter
only ever sees committed positions, so nothing here is undone when drafts are rejected; a slot
is freed when its request leaves.
"""

from __future__ import annotations

import numpy as np
import torch


class DraftContextCache:
    def __init__(self, num_layers: int, num_heads: int, head_dim: int, window: int, max_requests: int,
                 tap_width: int, device: torch.device | str = "cpu") -> None:
        if max_requests < 1:
            raise ValueError(f"the DSPARK context cache needs at least one request slot, got {max_requests}")
        shape = (num_layers, max_requests, window, num_heads, head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v = torch.zeros(shape, dtype=torch.float32, device=device)
        self.pos = torch.full((max_requests, window), -1, dtype=torch.long, device=device)
        self.taps = torch.zeros(max_requests, window, tap_width, dtype=torch.float32, device=device)
        self.unprojected = torch.zeros(max_requests, window, dtype=torch.bool, device=device)
        self.window, self.max_requests = window, max_requests
        self._slot: dict[str, int] = {}
        self._free = list(range(max_requests - 1, -1, -1))
        # On the CPU, rows are placed through numpy views of the same memory: its fancy-index
        # assignment of a step's rows costs a fraction of torch's index_copy_ (the per-step cost
        # of keeping the context while the policy decodes plainly).
        self._np = None
        if self.taps.device.type == "cpu":
            self._np = (self.pos.view(-1).numpy(), self.taps.view(-1, tap_width).numpy(), self.unprojected.view(-1).numpy())

    @staticmethod
    def bytes_for(num_layers: int, num_heads: int, head_dim: int, window: int, max_requests: int,
                  tap_width: int) -> int:
        return max_requests * window * (2 * num_layers * num_heads * head_dim * 4 + 8 + 4 * tap_width + 1)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.pos, self.taps, self.unprojected))

    def slot(self, request_id: str, create: bool = False) -> int | None:
        """The request's slot (a new one with ``create``; None when it has none or all are taken)."""
        s = self._slot.get(request_id)
        if s is None and create and self._free:
            s = self._slot[request_id] = self._free.pop()
        return s

    def stage(self, slots: torch.Tensor | list[int], positions: torch.Tensor | list[int], taps: torch.Tensor) -> None:
        """Rows at ``positions`` [R] of ``slots`` [R] (distinct (slot, position % window) pairs; tensors
        or integers) get the tapped states ``taps`` [R, tap_width]; their keys and values are computed
        later."""
        if self._np is not None:  # the CPU: fancy-index assignment through the numpy views
            positions = np.asarray(positions, dtype=np.int64)
            rows = np.asarray(slots, dtype=np.int64) * self.window + positions % self.window
            pos, rows_of_taps, unprojected = self._np
            pos[rows] = positions
            rows_of_taps[rows] = taps.detach().to("cpu", torch.float32).numpy()
            unprojected[rows] = True
            return
        dev = self.taps.device
        slots = torch.as_tensor(slots, dtype=torch.long, device=dev)
        positions = torch.as_tensor(positions, dtype=torch.long, device=dev)
        rows = slots * self.window + positions % self.window
        self.pos.view(-1).index_copy_(0, rows, positions)
        self.taps.view(-1, self.taps.shape[-1]).index_copy_(0, rows, taps.to(dev, torch.float32))
        self.unprojected.view(-1)[rows] = True

    def pending(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows of ``slots`` whose keys/values are not computed yet: (flat row indexes [P],
        their positions [P], their tapped states [P, tap_width])."""
        which = self.unprojected.index_select(0, slots).nonzero()
        rows = slots[which[:, 0]] * self.window + which[:, 1]
        return rows, self.pos.view(-1)[rows], self.taps.view(-1, self.taps.shape[-1])[rows]

    def write(self, rows: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Flat ``rows`` [P] (from :meth:`pending`) get each layer's (keys [P, H, D], values)."""
        for layer, (k, v) in enumerate(kv):
            self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, rows, k)
            self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, rows, v)
        self.unprojected.view(-1)[rows] = False

    def gather(self, slots: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Each layer's (keys [B, W, H, D], values) and the positions [B, W] of ``slots`` [B]."""
        kv = [(self.k[i].index_select(0, slots), self.v[i].index_select(0, slots)) for i in range(self.k.shape[0])]
        return kv, self.pos.index_select(0, slots)

    def release(self, request_id: str) -> None:
        s = self._slot.pop(request_id, None)
        if s is not None:
            self.pos[s] = -1
            self.unprojected[s] = False
            self._free.append(s)

    @property
    def num_free(self) -> int:
        return len(self._free)
