"""One worker process per rank behind the engine core.

The core schedules once and writes a step plan (``tidal.engine.plan``); it is broadcast to every
rank's worker over torch.distributed, each applies the plan's copies to its pool storage and runs
its shard of the model, and rank 0 sends back the logits the plan asks for (every rank has them
whole: lm_head gathers the vocabulary), which the core samples once.

The world is the ``tp_size`` workers (ranks 0 .. tp-1, the TP group of ``tidal.parallel.groups``)
plus the core as rank tp. Node k of ``nnodes`` hosts workers ``k tp/nnodes .. (k+1) tp/nnodes - 1``;
node 0 also hosts the core. A worker or core that loses a peer fails its next collective (gloo
raises on a closed connection, and every collective has a timeout), so a dead rank ends the step
with an error instead of a hang.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tidal.config import parse_dtype
from tidal.engine.plan import StepPlan, decode_plan, encode_plan
from tidal.parallel.groups import make_groups

log = logging.getLogger("tidal.parallel")

DEFAULT_TIMEOUT_S = 60.0


def node_ranks(tp_size: int, nnodes: int, node_rank: int) -> range:
    """The worker ranks node ``node_rank`` hosts."""
    if nnodes < 1 or tp_size % nnodes:
        raise ValueError(f"--nnodes {nnodes} must divide --tp-size {tp_size}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is not in 0..{nnodes - 1}")
    per = tp_size // nnodes
    return range(node_rank * per, (node_rank + 1) * per)


def _send_bytes(data: bytes, src: int) -> None:
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=src)
    if data:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src)


PING = -1  # a plan size that asks every rank to answer (a heartbeat of an idle core)
PING_TIMEOUT_S = 10.0


def _answer_ping() -> None:
    dist.all_reduce(torch.ones(1))


def _recv_bytes(src: int) -> bytes:
    """The next plan; pings are answered on the way."""
    size = torch.zeros(1, dtype=torch.int64)
    while True:
        dist.broadcast(size, src=src)
        if int(size) != PING:
            break
        _answer_ping()
    if not int(size):
        return b""
    buf = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src)
    return buf.numpy().tobytes()


def worker_main(rank: int, tp_size: int, ep_size: int, dcp_size: int, init_method: str, model_dir: str,
                dtype: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """A rank's process: join the world, load its shard, then run plans until the core says stop."""
    from tidal.engine.worker import Worker
    from tidal.parallel.loader import load_rank_model

    from tidal.serve.core_process import die_with_parent

    die_with_parent(os.getppid())  # no orphan: a worker whose launcher dies stops
    torch.set_num_threads(1)
    core = tp_size
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=tp_size + 1,
                            timeout=timedelta(seconds=timeout_s))
    try:
        comm = make_groups(tp_size, ep_size, dcp_size)
        model = load_rank_model(model_dir, comm.place, comm, parse_dtype(dtype))
        box: list = [None]
        dist.broadcast_object_list(box, src=core)  # the pool layout the core planned
        worker = Worker(model, box[0], cuda_graph=False, dcp_rank=comm.place.dcp_rank)
        while True:
            data = _recv_bytes(core)
            if not data:
                break
            logits = worker.execute(decode_plan(data))
            if rank == 0 and logits is not None:
                dist.send(torch.tensor(list(logits.shape), dtype=torch.int64), dst=core)
                dist.send(logits.contiguous(), dst=core)
    finally:
        dist.destroy_process_group()


def _spawn(rank: int, tp_size: int, ep_size: int, dcp_size: int, init_method: str, model_dir: str, dtype: str,
           timeout_s: float) -> subprocess.Popen:
    """A worker as its own process (``python -m tidal.parallel.workers``): the engine core may be a
    daemonic process, which multiprocessing does not let have children."""
    cmd = [sys.executable, "-m", "tidal.parallel.workers", "--rank", str(rank), "--tp-size", str(tp_size),
           "--ep-size", str(ep_size), "--dcp-size", str(dcp_size), "--init-method", init_method,
           "--model-dir", model_dir, "--dtype", dtype, "--timeout-s", str(timeout_s)]
    return subprocess.Popen(cmd)


class RankWorkers:
    """The engine core's worker when the model runs on ranks: ``execute(plan)`` as
    :class:`tidal.engine.worker.Worker`'s. Starts this node's worker processes (the other nodes run
    :func:`run_node`) and joins the world as its last rank."""

    def __init__(self, model_dir: str, dtype: str, *, tp_size: int, ep_size: int = 1, dcp_size: int = 1,
                 nnodes: int = 1, dist_init_addr: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        from tidal.parallel.launch import free_port

        self.tp_size = tp_size
        init_method = f"tcp://{dist_init_addr}" if dist_init_addr else f"tcp://127.0.0.1:{free_port()}"
        self.procs = [_spawn(r, tp_size, ep_size, dcp_size, init_method, model_dir, dtype, timeout_s)
                      for r in node_ranks(tp_size, nnodes, 0)]
        self.closed = False
        try:
            dist.init_process_group("gloo", init_method=init_method, rank=tp_size, world_size=tp_size + 1,
                                    timeout=timedelta(seconds=timeout_s))
            make_groups(tp_size, ep_size, dcp_size)
        except BaseException:
            self._reap()
            raise

    def start(self, layout: object) -> None:
        """Send the planned pool layout; each worker then builds its storage."""
        dist.broadcast_object_list([layout], src=self.tp_size)

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        _send_bytes(encode_plan(plan), self.tp_size)
        if not plan.logit_rows:
            return None
        shape = torch.zeros(2, dtype=torch.int64)
        dist.recv(shape, src=0)
        logits = torch.empty(*shape.tolist(), dtype=torch.float32)
        dist.recv(logits, src=0)
        return logits

    def alive(self) -> bool:
        """Whether every rank answers now (this node's processes are up and a heartbeat all-reduce
        over all ranks completes within PING_TIMEOUT_S); once False, the workers are unusable."""
        if self.closed or any(p.poll() is not None for p in self.procs):
            return False
        try:
            dist.broadcast(torch.tensor([PING], dtype=torch.int64), src=self.tp_size)
            ones = torch.ones(1)
            dist.all_reduce(ones, async_op=True).wait(timeout=timedelta(seconds=PING_TIMEOUT_S))
            return int(ones) == self.tp_size + 1
        except Exception:  # a lost or hung peer
            return False

    def close(self) -> None:
        """Stop the workers (a stop message, then kill whatever is left): no process outlives this."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.poll() is None for p in self.procs):
                _send_bytes(b"", self.tp_size)
        except Exception:  # a dead peer: nothing to tell
            pass
        self._reap()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _reap(self) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_node(model_dir: str, dtype: str, *, tp_size: int, ep_size: int, dcp_size: int, nnodes: int, node_rank: int,
             dist_init_addr: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """A node other than the first (``--node-rank`` k > 0): run its workers until the core stops
    them; the exit status is the first failing worker's (0 when all stopped cleanly)."""
    procs = [_spawn(r, tp_size, ep_size, dcp_size, f"tcp://{dist_init_addr}", model_dir, dtype, timeout_s)
             for r in node_ranks(tp_size, nnodes, node_rank)]
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return next((c for c in codes if c), 0)


def main() -> None:
    ap = argparse.ArgumentParser(description="one rank's worker (started by the engine core or run_node)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tp-size", type=int, required=True)
    ap.add_argument("--ep-size", type=int, default=1)
    ap.add_argument("--dcp-size", type=int, default=1)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    a = ap.parse_args()
    worker_main(a.rank, a.tp_size, a.ep_size, a.dcp_size, a.init_method, a.model_dir, a.dtype, a.timeout_s)


if __name__ == "__main__":
    main()
