"""tidal bench end to end against a live ``tidal serve`` (the embedded model) on 127.0.0.1: a short
concurrency sweep writes the table, the JSONL and the PNG; a short multi-turn row runs on chat."""

import json

import pytest

try:
    import tidal.serve.cli  # noqa: F401
    SERVE_ERROR = None
except ImportError as e:  # the server is built in its own issue
    SERVE_ERROR = f"tidal.serve.cli is not importable ({e}); the end-to-end bench test needs `tidal serve`"

pytestmark = pytest.mark.skipif(SERVE_ERROR is not None, reason=SERVE_ERROR or "")

from live_server import start_server  # noqa: E402

from tidal.bench.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def server():
    live = start_server()
    try:
        yield live.url
    finally:
        live.stop()


def read_rows(path):
    return [json.loads(line) for line in open(path)]


def test_concurrency_sweep_writes_table_jsonl_png(server, tmp_path, capsys):
    prefix = tmp_path / "sweep"
    rc = main(["--base-url", server, "--num-prompts", "3", "--input-len", "24", "--output-len", "6",
               "--max-concurrency", "1,2", "--warmup-requests", "1", "--output", str(prefix), "--no-progress"])
    assert rc == 0
    shown = capsys.readouterr().out
    assert "TTFT med (ms)" in shown and "ITL p99 (ms)" in shown and "output tok/s" in shown
    rows = read_rows(f"{prefix}.jsonl")
    assert [r["max_concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["completed"], r["failed"]) == (3, 0), r["error_examples"]
        assert r["total_output_tokens"] == 18                   # ignore_eos: exactly --output-len each
        assert r["total_input_tokens"] in (72, 75)              # 24-token prompts (+ BOS if the server adds one)
        assert r["median_ttft_ms"] > 0 and r["median_itl_ms"] > 0 and r["output_throughput"] > 0
    assert rows[0]["max_concurrent_requests"] == 1
    md = (tmp_path / "sweep.md").read_text()
    assert "| concurrency |" in md and md.count("\n| ") >= 3
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multiturn_row_on_chat(server, tmp_path):
    prefix = tmp_path / "agent"
    # Prefill runs on a CPU: keep the shared prefix small. The window leaves room for two completions
    # on a loaded 2-core machine.
    rc = main(["--base-url", server, "--dataset", "multiturn", "--max-concurrency", "2", "--max-duration", "8",
               "--system-len", "50", "--tool-result-len", "30", "--output-len", "4", "--turns", "2,3", "--tools", "0",
               "--task-len", "20",
               "--output", str(prefix), "--no-progress", "--no-plot"])
    assert rc == 0
    (row,) = read_rows(f"{prefix}.jsonl")
    assert row["endpoint"] == "chat" and row["dataset_name"] == "multiturn"
    assert row["completed"] >= 2 and row["failed"] == 0, row["error_examples"]
    assert row["duration"] == pytest.approx(8.0, abs=0.5)
