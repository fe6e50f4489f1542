"""Start one process per rank on this machine, joined by torch.distributed, and collect their results.

Used by the multi-rank tests and ``tidal generate --tp-size``: every rank runs the same function
(SPMD); a rank that raises or outlives the timeout stops them all, and no process is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch

from tidal.parallel.groups import Collectives, RankPlace, init_distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(target: Callable[..., Any], place: RankPlace, init_method: str, args: tuple, results: Any,
               threads: int, world_size: int | None) -> None:
    torch.set_num_threads(threads)
    try:
        comm = init_distributed(place, init_method, "cpu", world_size=world_size)
        # plain pickle: tensors travel as bytes, not as shared memory the exiting rank would take along
        results.put((place.rank, True, pickle.dumps(target(place, comm, *args))))
    except BaseException:  # reported to the launcher, which stops every rank
        results.put((place.rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class RankError(RuntimeError):
    """A rank failed or timed out; the message carries its traceback."""


def run_ranks(
    target: Callable[[RankPlace, Collectives], Any] | Callable[..., Any], *, tp_size: int, ep_size: int = 1,
    dcp_size: int = 1, args: tuple = (), timeout_s: float = 300.0, threads: int = 1, world_size: int | None = None,
) -> list[Any]:
    """``target(place, comm, *args)`` on ``tp_size`` new processes (a picklable, importable function);
    their return values in rank order. ``world_size``: see :func:`init_distributed`."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(target, RankPlace(r, tp_size, ep_size, dcp_size), init_method, args, results, threads,
                               world_size))
             for r in range(tp_size)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < tp_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankError(f"ranks {sorted(set(range(tp_size)) - set(got))} did not finish in {timeout_s:g} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise RankError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} before reporting")
                continue
            if not ok:
                raise RankError(f"rank {rank} failed:\n{value}")
            got[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == tp_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(tp_size)]
