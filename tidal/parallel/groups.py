"""Where a rank sits in TP / EP / DCP, and the torch.distributed groups and collectives it uses.

One tensor-parallel group of ``tp_size`` ranks (all of them: no data or pipeline parallelism). EP and
DCP reuse its ranks, as in SGLang and the planner (``tidal.plan.sglang.check_parallel``):

- MoE: ``ep_size`` groups of ``tp_size / ep_size`` consecutive ranks; group g holds experts
  ``[g E/ep, (g+1) E/ep)``, each cut into ``tp / ep`` intermediate slices, one per rank of the group.
- DCP: ``tp_size / dcp_size`` groups of ``dcp_size`` consecutive ranks; inside a group rank j stores
  the MLA latents of logical tokens ``i`` with ``i % dcp_size == j`` and attends over them with every
  head of the group (the group's ranks hold consecutive head slices).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tidal.config import ModelConfig
from tidal.plan.sglang import Parallel, check_parallel


@dataclass(frozen=True)
class RankPlace:
    """This rank's coordinates; sizes as SGLang's flags name them."""

    rank: int
    tp_size: int = 1
    ep_size: int = 1
    dcp_size: int = 1

    def __post_init__(self) -> None:
        for flag, v in (("--tp-size", self.tp_size), ("--ep-size", self.ep_size), ("--dcp-size", self.dcp_size)):
            if v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        for flag, v, what in (("--ep-size", self.ep_size, "EP"), ("--dcp-size", self.dcp_size, "DCP")):
            if self.tp_size % v:
                raise ValueError(f"{flag} {v} does not divide --tp-size {self.tp_size} ({what} reuses the TP ranks)")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.tp_size - 1}")

    @property
    def tp_rank(self) -> int:
        return self.rank

    @property
    def moe_tp_size(self) -> int:
        """Ranks that split one expert's intermediate width."""
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    @property
    def dcp_rank(self) -> int:
        return self.rank % self.dcp_size

    @property
    def dcp_group(self) -> int:
        return self.rank // self.dcp_size

    def check(self, config: ModelConfig) -> None:
        """Raise (naming the size) when the model does not split this way."""
        check_parallel(config, Parallel(self.tp_size, self.dcp_size, self.ep_size))


class Collectives:
    """The collectives the parallel layers call, over the TP group and this rank's DCP group.
    A size-1 group's collectives are the identity (no process group is needed for TP 1)."""

    def __init__(self, place: RankPlace, tp_group: object | None, dcp_group: object | None) -> None:
        self.place, self.tp_group, self.dcp_group = place, tp_group, dcp_group

    def all_reduce(self, x: torch.Tensor, dcp: bool = False) -> torch.Tensor:
        """Sum over the TP group, or the DCP group (in place on a contiguous copy; returns it)."""
        if (self.place.dcp_size if dcp else self.place.tp_size) == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=self.dcp_group if dcp else self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int, dcp: bool = False) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order (TP group, or the DCP group)."""
        size = self.place.dcp_size if dcp else self.place.tp_size
        if size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=self.dcp_group if dcp else self.tp_group)
        return torch.cat(parts, dim=dim)


def backend_for(device: str) -> str:
    """The process-group backend for ranks whose model lives on ``device``: gloo on the CPU; on CUDA
    NCCL for the CUDA tensors and gloo for the CPU ones every rank also sends (step plans, pings,
    the logits for the core), so a CUDA rank's world is ``"cpu:gloo,cuda:nccl"``."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def init_distributed(
    place: RankPlace, init_method: str, device: str = "cpu", timeout_s: float = 60.0,
    world_size: int | None = None,
) -> Collectives:
    """Join the ranks (``init_method``: "tcp://host:port", SGLang's --dist-init-addr) and make this
    layout's groups, over :func:`backend_for` ``device`` (the rank's, not whether this machine has a
    GPU). ``world_size`` (default tp_size) may be larger: then :func:`make_groups` can carve several
    layouts out of one set of processes (the tests do)."""
    if place.tp_size == 1 and not world_size:
        return Collectives(place, None, None)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), init_method=init_method, rank=place.rank,
                                world_size=world_size or place.tp_size, timeout=timedelta(seconds=timeout_s))
    return make_groups(place.tp_size, place.ep_size, place.dcp_size)


def make_groups(tp_size: int, ep_size: int = 1, dcp_size: int = 1) -> Collectives:
    """The TP group (world ranks 0 .. tp_size - 1) and its DCP subgroups. Every process of the world
    calls it, in the same order (torch.distributed requires it); a process outside the TP group
    gets Collectives whose place is None."""
    world, rank = dist.get_world_size(), dist.get_rank()
    whole = tp_size == world
    tp_group = dist.group.WORLD if whole else dist.new_group(list(range(tp_size)))
    dcp_group = None
    if dcp_size > 1:
        for g in range(tp_size // dcp_size):
            ranks = list(range(g * dcp_size, (g + 1) * dcp_size))
            group = tp_group if dcp_size == tp_size else dist.new_group(ranks)
            if rank in ranks:
                dcp_group = group
    if rank >= tp_size:
        return Collectives(None, None, None)  # type: ignore[arg-type]
    return Collectives(RankPlace(rank, tp_size, ep_size, dcp_size), tp_group, dcp_group)
