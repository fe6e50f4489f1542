"""Heartbeats of the rank workers and the engine core's watchdog over them.

A rank that dies closes its connections, and its peers' next collective fails. A rank that hangs
(stopped, frozen, its host unreachable) closes nothing: every peer would wait out the collective
timeout (``--dist-timeout``), which must be longer than the longest step. So each worker also
beats a counter in the rendezvous store from a thread of its own (``Heartbeat``), and the core's
``Watchdog`` reads the counters: a rank whose counter stands still for ``timeout_s`` is lost within
seconds however long a step runs. A rank that runs but whose collectives never complete still
beats; the collective timeout catches that one.

Losing a rank ends the world (a TP world cannot run short of a rank): the watchdog kills this
node's workers, which fails the collective the core is blocked in, and the engine is dead.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("tidal.parallel")

HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 5.0


LOST_KEY = "tidal/lost"  # set by the core once a rank is lost: every worker still running exits


def heartbeat_key(rank: int) -> str:
    return f"tidal/heartbeat/{rank}"


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A connection of its own to the rendezvous store (one per thread)."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


class Heartbeat:
    """A worker's thread that counts up ``heartbeat_key(rank)`` every HEARTBEAT_INTERVAL_S. A store
    that no longer answers (the core is gone) or says LOST_KEY (the world is broken) ends the
    worker, wherever it waits: no orphan on another node."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.store = store_client(host, port, timeout_s)
        self.key = heartbeat_key(rank)
        self.store.add(self.key, 1)
        threading.Thread(target=self._beat, name="tidal-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_INTERVAL_S)
            try:
                self.store.add(self.key, 1)
                if self.store.check([LOST_KEY]):
                    log.error("a rank was lost (%s): this worker exits", self.store.get(LOST_KEY).decode())
                    os._exit(1)
            except Exception:  # noqa: BLE001 - the core (the store's host) is gone
                log.error("the engine core's store stopped answering: this worker exits")
                os._exit(1)


class Watchdog:
    """The core's thread over ``ranks``: a rank whose heartbeat stands still for ``timeout_s`` (once
    it has beaten: start-up is the rendezvous' business), or a local worker process that exits,
    is lost: ``on_lost(reason)`` runs once, then this node's workers are killed."""

    def __init__(self, host: str, port: int, ranks: range, procs: dict[int, subprocess.Popen],
                 on_lost: Callable[[str], None], timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.store = store_client(host, port, max(timeout_s, 30.0))
        self.ranks, self.procs, self.on_lost, self.timeout_s = ranks, procs, on_lost, timeout_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="tidal-watchdog", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()

    def _watch(self) -> None:
        seen: dict[int, tuple[int, float]] = {}  # rank -> (last count, when it changed)
        exit_seen: float | None = None  # when a local worker was first seen gone by an exit code
        while not self._stop.wait(HEARTBEAT_INTERVAL_S / 2):
            now = time.monotonic()
            reason = self.exited()
            gone = {r for r, p in self.procs.items() if p.poll() is not None}
            if reason is not None and not self._caused_by_a_signal() and len(self.procs) < len(self.ranks):
                # A worker that exits by itself most often saw a collective fail: a rank on another
                # node may have gone first. Its heartbeat names it within timeout_s; wait for that.
                exit_seen = now if exit_seen is None else exit_seen
                if now - exit_seen <= self.timeout_s + HEARTBEAT_INTERVAL_S:
                    reason = None
            for r in self.ranks:
                if reason is not None:
                    break
                if r in gone:
                    continue
                try:
                    count = self.store.add(heartbeat_key(r), 0)
                except Exception as e:  # noqa: BLE001
                    reason = f"the rendezvous store failed: {e}"
                    break
                last = seen.get(r)
                if count and (last is None or count != last[0]):
                    seen[r] = (count, now)
                elif last is not None and now - last[1] > self.timeout_s:
                    pid = f" (pid {self.procs[r].pid})" if r in self.procs else ""
                    reason = f"rank {r}{pid} stopped answering: no heartbeat for {now - last[1]:.1f} s"
            if reason is not None and not self._stop.is_set():
                log.error("tensor-parallel rank lost: %s", reason)
                self.on_lost(reason)
                kill_all(self.procs.values())
                return

    def _caused_by_a_signal(self) -> bool:
        return any((p.poll() or 0) < 0 for p in self.procs.values())

    def exited(self) -> str | None:
        """Why a local worker is gone (None while all run): one killed by a signal before one that
        exited by itself (which, most often, saw the killed one's collectives fail)."""
        gone = [(r, p, p.poll()) for r, p in self.procs.items() if p.poll() is not None]
        if not gone:
            return None
        r, p, code = min(gone, key=lambda g: (g[2] >= 0, g[0]))
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"rank {r}'s worker (pid {p.pid}) exited ({how})"

    def decided(self, within_s: float) -> None:
        """Wait until this watchdog has named the lost rank (it exits then), ``within_s`` at most."""
        self.thread.join(timeout=within_s)


def kill_all(procs) -> None:
    """SIGKILL (a stopped process too) and reap."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
