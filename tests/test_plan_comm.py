"""`tidal plan` prints the bytes each rank hands to collectives per decode step (tidal.plan.comm),
and they are the bytes real ranks count: two gloo processes (TP 2 + DCP 2 on a tiny K3 with KDA,
MLA, a dense layer, latent MoE and shared experts) run an engine's decode steps with every
collective wrapped in a counter (benchmarks/bench_parallel_comm.py's), against the plan's figures
times the batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import bench_parallel_comm as bench  # noqa: E402
import parallel_ranks as pr  # noqa: E402
from tidal.parallel.launch import run_ranks  # noqa: E402


def _plan(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "plan", *args], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_tidal_plan_prints_the_collective_bytes_ranks_count(tmp_path) -> None:
    ckpt = str(pr.make_checkpoint("k3", tmp_path / "k3"))
    layout = ["--model", ckpt, "--gpu-memory", "8", "--tp-size", "2", "--dcp-size", "2"]
    per_sequence = json.loads(_plan(*layout, "--json"))["decode_comm_bytes_per_sequence"]
    assert {"embedding", "kda", "mla", "mla_dcp", "dense_mlp", "moe", "lm_head"} == set(per_sequence)
    text = _plan(*layout)
    total = sum(v["payload_bytes"] for v in per_sequence.values())
    assert "collectives per decode step" in text and f"{total:,} B" in text
    batch = 3
    counted = run_ranks(bench._rank, tp_size=2, dcp_size=2, args=(ckpt, batch, 2, "float32"), timeout_s=600)
    want = {kind: batch * v["payload_bytes"] for kind, v in per_sequence.items()}
    for rank, counts in enumerate(counted):
        assert counts == want, rank
    assert "decode_comm_bytes_per_sequence" in _plan("--model", ckpt, "--gpu-memory", "8", "--json")
    assert json.loads(_plan("--model", ckpt, "--gpu-memory", "8", "--json"))["decode_comm_bytes_per_sequence"] == {}
