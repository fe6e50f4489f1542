"""Tensor, expert and decode-context parallelism over torch.distributed (see groups.py for the layout)."""

from tidal.parallel.groups import Collectives, RankPlace, init_distributed

__all__ = ["Collectives", "RankPlace", "init_distributed"]
