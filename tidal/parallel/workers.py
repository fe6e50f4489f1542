"""One worker process per rank behind the engine core.

The core schedules once and writes a step plan (``tidal.engine.plan``); it is broadcast to every
rank's worker over torch.distributed, each applies the plan's copies to its pool storage and runs
its shard of the model, and rank 0 sends back the logits the plan asks for (every rank has them
whole: lm_head gathers the vocabulary), which the core samples once.

The world is the ``tp_size`` workers (ranks 0 .. tp-1, the TP group of ``tidal.parallel.groups``)
plus the core as rank tp, which hosts the rendezvous store. Node k of ``nnodes`` hosts workers
``k tp/nnodes .. (k+1) tp/nnodes - 1``; node 0 also hosts the core. Faults: a rank that dies fails
its peers' next collective (gloo raises on a closed connection); one that hangs is found by the
heartbeat watchdog (``tidal.parallel.watchdog``) within seconds, and every collective has a
timeout (``--dist-timeout``). Either way the step raises :class:`WorkerLostError` instead of hanging.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tidal.config import parse_dtype
from tidal.engine.faults import WorkerLostError
from tidal.engine.plan import StepPlan, decode_plan, encode_plan
from tidal.parallel.flags import node_ranks, split_addr
from tidal.parallel.groups import backend_for, make_groups
from tidal.plan.layout import PoolLayout
from tidal.parallel.watchdog import HEARTBEAT_TIMEOUT_S, LOST_KEY, Heartbeat, Watchdog, heartbeat_key, kill_all

log = logging.getLogger("tidal.parallel")

DEFAULT_TIMEOUT_S = 60.0
# Test hook: "R:N" stops rank R's main thread before its N-th step while its heartbeat goes on, a
# rank whose collectives never complete (only the collective timeout, --dist-timeout, finds it).
HANG_ENV = "TIDAL_RANK_HANG"
# How long the ranks wait for each other to start (process start, imports, other nodes' launches)
# before the collectives' timeout applies: a loaded machine may take minutes.
STARTUP_TIMEOUT_S = 600.0


def rank_device(device: str, local_rank: int) -> str:
    """A rank's device: the CPU, or its node's ``local_rank``-th GPU (one GPU per rank)."""
    if not device.startswith("cuda"):
        return "cpu"
    return f"cuda:{local_rank}"


def loaded_key(rank: int) -> str:
    return f"tidal/loaded/{rank}"  # {"bytes": read, "seconds": its load}


def load_bytes_key(rank: int) -> str:
    return f"tidal/load_bytes/{rank}"  # bytes read so far


LOAD_PROGRESS_S = 2.0  # seconds between the load's progress lines (and the ranks' reports)


def _report_load(store: dist.TCPStore, rank: int):
    """A rank's load progress into the store, every LOAD_PROGRESS_S / 4 at most."""
    last = [0.0]

    def report(nbytes: int) -> None:
        now = time.monotonic()
        if now - last[0] >= LOAD_PROGRESS_S / 4:
            last[0] = now
            store.set(load_bytes_key(rank), str(nbytes))

    return report


def memory_key(rank: int) -> str:
    return f"tidal/memory/{rank}"


@dataclass(frozen=True)
class RankMemory:
    """What one rank allocated, to set beside the planner's per-rank figures."""

    weight_bytes: int  # its shard's parameters and buffers
    pool_bytes: int  # its pool storage
    kv_tokens: int  # latent rows its pool holds with every block as KV pages: its DCP share
    device: str

    @classmethod
    def of(cls, model: torch.nn.Module, storage: object) -> RankMemory:
        from tidal.engine.core import model_bytes

        buf = storage.buffer  # type: ignore[attr-defined]
        return cls(model_bytes(model), buf.numel() * buf.element_size(), storage.kv_token_rows,  # type: ignore[attr-defined]
                   str(buf.device))


def _send_bytes(data: bytes, src: int) -> None:
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=src)
    if data:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src)


PING = -1  # a plan size that asks every rank to answer (an idle core's keep-alive of the plan wait)
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
                dtype: str, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu",
                quantization: str | None = None, safetensors_load_strategy: str = "lazy") -> None:
    """A rank's process: join the world, load its shard, then run plans until the core says stop."""
    from tidal.engine.worker import Worker
    from tidal.model.checkpoint import use_mmap_for
    from tidal.parallel.loader import load_rank_model
    from tidal.serve.core_process import die_with_parent

    die_with_parent(os.getppid())  # no orphan: a worker whose launcher dies stops
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    core, world = tp_size, tp_size + 1
    host, port = split_addr(init_method)
    store = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
    Heartbeat(host, port, rank)
    store.wait([heartbeat_key(r) for r in range(tp_size)], timedelta(seconds=STARTUP_TIMEOUT_S))  # all started
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        comm = make_groups(tp_size, ep_size, dcp_size)
        t0 = time.perf_counter()
        model = load_rank_model(model_dir, comm.place, comm, parse_dtype(dtype), device, quantization,
                                progress=_report_load(store, rank), use_mmap=use_mmap_for(safetensors_load_strategy))
        store.set(loaded_key(rank), json.dumps({"bytes": model.loaded_bytes, "seconds": time.perf_counter() - t0}))
        box: list = [None]
        dist.broadcast_object_list(box, src=core, device=torch.device("cpu"))  # the layout the core planned
        worker = Worker(model, box[0], cuda_graph=False, dcp_rank=comm.place.dcp_rank)
        store.set(memory_key(rank), json.dumps(asdict(RankMemory.of(model, worker.storage))))
        hang = os.environ.get(HANG_ENV, "").split(":")
        hang_at = int(hang[1]) if len(hang) == 2 and hang[0] == str(rank) else 0
        steps = 0
        while True:
            data = _recv_bytes(core)
            if not data:
                break
            steps += 1
            if steps == hang_at:
                threading.Event().wait()
            logits = worker.execute(decode_plan(data))
            if rank == 0 and logits is not None:
                logits = logits.float().cpu().contiguous()  # to the core over gloo
                dist.send(torch.tensor(list(logits.shape), dtype=torch.int64), dst=core)
                dist.send(logits, dst=core)
    finally:
        dist.destroy_process_group()


def _spawn(rank: int, tp_size: int, ep_size: int, dcp_size: int, init_method: str, model_dir: str, dtype: str,
           timeout_s: float, device: str, quantization: str | None, load_strategy: str) -> subprocess.Popen:
    """A worker as its own process (``python -m tidal.parallel.workers``): the engine core may be a
    daemonic process, which multiprocessing does not let have children."""
    cmd = [sys.executable, "-m", "tidal.parallel.workers", "--rank", str(rank), "--tp-size", str(tp_size),
           "--ep-size", str(ep_size), "--dcp-size", str(dcp_size), "--init-method", init_method,
           "--model-dir", model_dir, "--dtype", dtype, "--timeout-s", str(timeout_s), "--device", device]
    if quantization:
        cmd += ["--quantization", quantization]
    return subprocess.Popen([*cmd, "--safetensors-load-strategy", load_strategy])


def _spawn_node(ranks: range, tp_size: int, ep_size: int, dcp_size: int, init_method: str, model_dir: str,
                dtype: str, timeout_s: float, device: str, quantization: str | None,
                load_strategy: str) -> list[subprocess.Popen]:
    return [_spawn(r, tp_size, ep_size, dcp_size, init_method, model_dir, dtype, timeout_s,
                   rank_device(device, r - ranks.start), quantization, load_strategy) for r in ranks]


class RankWorkers:
    """The engine core's worker when the model runs on ranks: ``execute(plan)`` as
    :class:`tidal.engine.worker.Worker`'s. Hosts the rendezvous store, starts this node's worker
    processes (the other nodes run :func:`run_node`) and joins the world as its last rank.
    ``lost``: why the ranks can no longer run a step (None while they can)."""

    def __init__(self, model_dir: str, dtype: str, *, tp_size: int, ep_size: int = 1, dcp_size: int = 1,
                 nnodes: int = 1, dist_init_addr: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: str = "cpu", quantization: str | None = None, safetensors_load_strategy: str = "lazy") -> None:
        self.tp_size = tp_size
        self.lost: str | None = None
        self.closed = False
        self.memory: list[RankMemory] = []  # per rank, once started
        self._started = self._shown = time.monotonic()
        host, port = split_addr(dist_init_addr) if dist_init_addr else ("127.0.0.1", 0)
        ranks = node_ranks(tp_size, nnodes, 0)
        td = timedelta(seconds=timeout_s)
        # The core hosts the store: it outlives every worker, and their heartbeats land in it.
        self.store = dist.TCPStore(host, port, tp_size + 1, is_master=True, wait_for_workers=False, timeout=td)
        init_method = f"tcp://{host}:{self.store.port}"
        self.procs = _spawn_node(ranks, tp_size, ep_size, dcp_size, init_method, model_dir, dtype, timeout_s,
                                 device, quantization, safetensors_load_strategy)
        self.watchdog = Watchdog(host, self.store.port, range(tp_size), dict(zip(ranks, self.procs)), self._lose)
        try:
            self._wait_for(heartbeat_key, deadline=time.monotonic() + STARTUP_TIMEOUT_S)  # every rank started
            dist.init_process_group(backend_for(device), store=self.store, rank=tp_size,
                                    world_size=tp_size + 1, timeout=td)
            make_groups(tp_size, ep_size, dcp_size)
        except BaseException:
            self.watchdog.stop()
            kill_all(self.procs)
            raise

    def _lose(self, reason: str) -> None:
        """The first reason wins; the workers still running (on any node) read it and exit."""
        if self.lost is not None:
            return
        self.lost = reason
        try:  # (a TCPStore client serialises its operations: both threads may use it)
            self.store.set(LOST_KEY, reason)
        except Exception:  # noqa: BLE001 - this node's workers are killed anyway
            pass

    def start(self, layout: PoolLayout) -> None:
        """Once every rank has loaded its shard, send the planned pool layout; each worker then
        builds its storage and says what it allocated (``memory``). A rank lost meanwhile fails
        the start."""
        self._wait_for(loaded_key, self._show_load)
        done = [json.loads(self.store.get(loaded_key(r))) for r in range(self.tp_size)]
        total, slowest = sum(d["bytes"] for d in done), max(d["seconds"] for d in done)
        log.info("loaded %d ranks' shards: %.3f GB read in %.2f s, %.3f GB/s aggregate", self.tp_size, total / 1e9,
                 slowest, total / 1e9 / max(slowest, 1e-9))
        dist.broadcast_object_list([layout], src=self.tp_size, device=torch.device("cpu"))
        self._wait_for(memory_key)
        self.memory = [RankMemory(**json.loads(self.store.get(memory_key(r)))) for r in range(self.tp_size)]
        planned = (layout.num_blocks * layout.block_bytes, layout.kv_tokens_per_rank)
        for r, m in enumerate(self.memory):
            log.info("rank %d on %s: %.3f GiB of weights, a %.3f GiB pool (%d KV tokens of its DCP share)",
                     r, m.device, m.weight_bytes / 2**30, m.pool_bytes / 2**30, m.kv_tokens)
            if (m.pool_bytes, m.kv_tokens) != planned:
                log.warning("rank %d allocated a pool of %d bytes for %d KV tokens; the plan says %d bytes, %d tokens",
                            r, m.pool_bytes, m.kv_tokens, *planned)

    def _wait_for(self, key, tick=None, deadline: float | None = None) -> None:
        """Until every rank has set ``key(rank)`` in the store, or one is lost (or ``deadline``
        passes); ``tick()`` on the way."""
        keys = [key(r) for r in range(self.tp_size)]
        while not self.store.check(keys):
            if self.lost is not None:
                raise WorkerLostError(self.lost)
            if deadline is not None and time.monotonic() > deadline:
                missing = [r for r in range(self.tp_size) if not self.store.check([key(r)])]
                raise WorkerLostError(f"ranks {missing} did not start within {STARTUP_TIMEOUT_S:.0f} s")
            if tick is not None:
                tick()
            time.sleep(0.05)

    def _show_load(self) -> None:
        """One progress line for all ranks' loads, every LOAD_PROGRESS_S."""
        now = time.monotonic()
        if now - self._shown < LOAD_PROGRESS_S:
            return
        self._shown = now
        keys = [load_bytes_key(r) for r in range(self.tp_size)]
        read = sum(int(self.store.get(k)) for k in keys if self.store.check([k]))
        if read:
            log.info("loading on %d ranks: %.2f GB read, %.2f GB/s", self.tp_size, read / 1e9,
                     read / 1e9 / (now - self._started))

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        if self.lost is not None:
            raise WorkerLostError(self.lost)
        try:
            _send_bytes(encode_plan(plan), self.tp_size)
            if not plan.logit_rows:
                return None
            shape = torch.zeros(2, dtype=torch.int64)
            dist.recv(shape, src=0)
            logits = torch.empty(*shape.tolist(), dtype=torch.float32)
            dist.recv(logits, src=0)
            return logits
        except Exception as e:  # a lost or hung peer: the world cannot run another step
            self._fail(f"a collective with the ranks failed: {e}")
            raise WorkerLostError(self.lost) from e

    def alive(self) -> bool:
        """Whether every rank answers now (no rank lost, and a heartbeat all-reduce over all ranks
        completes within PING_TIMEOUT_S); once False, the workers are unusable."""
        if self.closed or self.lost is not None:
            return False
        try:
            dist.broadcast(torch.tensor([PING], dtype=torch.int64), src=self.tp_size)
            ones = torch.ones(1)
            dist.all_reduce(ones, async_op=True).wait(timeout=timedelta(seconds=PING_TIMEOUT_S))
            if int(ones) != self.tp_size + 1:
                raise RuntimeError(f"the ping all-reduce summed to {int(ones)}, not {self.tp_size + 1}")
            return True
        except Exception as e:  # noqa: BLE001
            self._fail(f"the ranks did not answer a ping: {e}")
            return False

    def _fail(self, reason: str) -> None:
        """The world is broken: name why (a watchdog's finding, or a local worker's exit, wins over a
        collective's error) and kill this node's workers."""
        # A killed peer fails the collective before its exit shows, and a peer on another node is
        # named by its heartbeat: the watchdog's finding names the rank, ``reason`` does not.
        self.watchdog.decided(HEARTBEAT_TIMEOUT_S + 2.0)
        self._lose(reason)
        kill_all(self.procs)

    def close(self) -> None:
        """Stop the workers (a stop message, then kill whatever is left): no process outlives this."""
        if self.closed:
            return
        self.closed = True
        self.watchdog.stop()
        try:
            if self.lost is None and all(p.poll() is None for p in self.procs):
                _send_bytes(b"", self.tp_size)
        except Exception:  # noqa: BLE001 - a dead peer: nothing to tell
            pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        kill_all(self.procs)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_node(model_dir: str, dtype: str, *, tp_size: int, ep_size: int, dcp_size: int, nnodes: int, node_rank: int,
             dist_init_addr: str, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu",
             quantization: str | None = None, safetensors_load_strategy: str = "lazy") -> int:
    """A node other than the first (``--node-rank`` k > 0): run its workers until the core stops
    them; the exit status is the first failing worker's (0 when all stopped cleanly)."""
    host, port = split_addr(dist_init_addr)
    procs = _spawn_node(node_ranks(tp_size, nnodes, node_rank), tp_size, ep_size, dcp_size, f"tcp://{host}:{port}",
                        model_dir, dtype, timeout_s, device, quantization, safetensors_load_strategy)
    try:
        codes = [p.wait() for p in procs]
    finally:
        kill_all(procs)
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
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--safetensors-load-strategy", default="lazy", choices=("lazy", "eager"))
    a = ap.parse_args()
    worker_main(a.rank, a.tp_size, a.ep_size, a.dcp_size, a.init_method, a.model_dir, a.dtype, a.timeout_s,
                a.device, a.quantization, a.safetensors_load_strategy)


if __name__ == "__main__":
    main()
