"""The parallel flags of ``tidal serve`` (SGLang's names): a combination that does not describe one
launch of the ranks is a clear error naming the flag (exit status 2) before any process starts or
the port is taken; and the ranks' process-group backend follows their device, not the machine."""

from __future__ import annotations

import socket

import pytest
import torch

from tidal.cli import main
from tidal.parallel.groups import backend_for
from tidal.parallel.launch import run_ranks


@pytest.mark.parametrize(("flags", "message"), [
    (["--tp-size", "4", "--ep-size", "3"], "--ep-size 3 does not divide --tp-size 4"),
    (["--tp-size", "4", "--dcp-size", "8"], "--dcp-size 8 does not divide --tp-size 4"),
    (["--tp-size", "6", "--ep-size", "2", "--dcp-size", "4"], "--dcp-size 4 does not divide --tp-size 6"),
    (["--ep-size", "2"], "--ep-size 2 does not divide --tp-size 1"),
    (["--tp-size", "0"], "--tp-size must be >= 1, got 0"),
    (["--tp-size", "2", "--dcp-size", "-2"], "--dcp-size must be >= 1, got -2"),
    (["--tp-size", "4", "--nnodes", "3", "--dist-init-addr", "127.0.0.1:5000"], "--nnodes 3 must divide --tp-size 4"),
    (["--tp-size", "2", "--nnodes", "0"], "--nnodes 0 must divide --tp-size 2"),
    (["--tp-size", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:5000"],
     "--node-rank 2 is not in 0..1"),
    (["--tp-size", "2", "--node-rank", "-1"], "--node-rank -1 is not in 0..0"),
    (["--tp-size", "2", "--nnodes", "2"], "--nnodes 2 needs --dist-init-addr"),
    (["--tp-size", "2", "--dist-init-addr", "127.0.0.1"], "--dist-init-addr '127.0.0.1': expected host:port"),
    (["--tp-size", "2", "--dist-init-addr", ":5000"], "--dist-init-addr ':5000': expected host:port"),
    (["--tp-size", "2", "--dist-init-addr", "host:port"], "--dist-init-addr 'host:port': expected host:port"),
    (["--tp-size", "2", "--dist-init-addr", "127.0.0.1:70000"], "a port in 0..65535"),
    (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:0"], "the other nodes need a fixed port"),
])
def test_bad_parallel_flags_are_a_clear_error_before_anything_starts(flags, message, capsys) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:  # past the flags, serve would fail on the port
        assert main(["serve", "--port", str(taken.getsockname()[1]), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tidal serve: ") and message in err, err


def test_the_backend_follows_the_ranks_device() -> None:
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda") == backend_for("cuda:1") == "cpu:gloo,cuda:nccl"


def _backend(place, comm) -> str:
    return torch.distributed.get_backend()


def test_cpu_ranks_join_over_gloo() -> None:
    """Two real rank processes on the CPU (whatever GPUs the machine has) join over gloo."""
    assert run_ranks(_backend, tp_size=2, timeout_s=120) == ["gloo", "gloo"]
