"""Served against offline, and tidal serve against llama-server, on one model, in one command.

    python benchmarks/bench_serve_vs_offline.py               # the 223M K3 model, bf16, 512 in / 128 out
    python benchmarks/bench_serve_vs_offline.py --skip-llamacpp

1. The offline decode step: ``LLM.generate`` on one 512-token prompt, (t(128 tokens) - t(1 token)) / 127.
2. ``tidal serve`` (engine core in its own process) at concurrency 1: the mean inter-token latency
   ``tidal bench`` measures; the ratio to (1) is what the engine-process split is for (target <= 1.15).
3. Output tok/s of ``tidal serve`` and ``llama-server`` (llama.cpp from the llama-cpp-python sdist of
   benchmarks/vs_llamacpp.py, built with its server into ~/.cache/tidal/llamacpp/build-server) at
   concurrency 1 / 4 / 16, same GGUF-converted checkpoint, same token-id prompts, ignore_eos.

The checkpoint is vs_llamacpp's (benchmarks/configs/k3-223m.json: the text model of
../shared/spec/bench-223m-config.json, random weights, MXFP4 experts, bf16 trunk). Servers run one at
a time on the same cores; ratios from one run are the figures to read (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import tidal  # first: its OpenMP wait policy must be set before torch loads libgomp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import active_weight_bytes, read_bandwidth  # noqa: E402
from vs_llamacpp import CONFIG, LLAMA, VERSION, build_llamacpp, checkpoint, gguf, prompts, run  # noqa: E402

from tidal import LLM, SamplingParams  # noqa: E402

SERVER_BUILD = LLAMA / "build-server"
# Random weights pick tokens whose bytes are rarely valid UTF-8, so a served stream holds its text
# back and delivers it in one chunk at the end (no inter-token latency to measure). Every run here,
# offline and served, both servers, adds this bias to the byte-level BPE's single printable ASCII
# characters (ids 0-93), so each token is text the moment it is sampled.
TEXT_BIAS = {str(i): 100 for i in range(94)}


def llama_server_binary() -> tuple[Path, Path]:
    """(llama.cpp source dir, llama-server), building the server target once into the cache."""
    src, _ = build_llamacpp()
    binary = SERVER_BUILD / "bin" / "llama-server"
    if not binary.exists():
        print(f"building llama-server {VERSION} into {SERVER_BUILD} (several minutes)", flush=True)
        run(["nice", "cmake", "-S", str(src), "-B", str(SERVER_BUILD), "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON",
             "-DLLAMA_OPENSSL=OFF"])
        run(["nice", "cmake", "--build", str(SERVER_BUILD), f"-j{os.cpu_count()}", "--target", "llama-server"])
    return src, binary


def offline_step_ms(model_dir: Path, vocab: int, input_len: int, output_len: int) -> tuple[float, float]:
    """(decode step ms, batch-1 bound ms from weight bytes / read bandwidth)."""
    llm = LLM(str(model_dir), dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 30)
    bias = {int(k): v for k, v in TEXT_BIAS.items()}

    def timed(batch: list[dict], tokens: int) -> float:
        t0 = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logit_bias=bias))
        return time.perf_counter() - t0

    timed(prompts(vocab, 1, 16, seed=0), 4)  # warm-up
    one = prompts(vocab, 1, input_len, seed=1)
    t1 = min(timed(one, 1) for _ in range(2))
    tn = min(timed(one, output_len) for _ in range(2))
    per_tok = active_weight_bytes(llm.engine.model)
    bound = per_tok / read_bandwidth(per_tok)
    return (tn - t1) / (output_len - 1) * 1e3, bound * 1e3


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready in {timeout} s")


def bench(url: str, concurrency: int, args: argparse.Namespace, vocab: int, extra: list[str]) -> dict:
    """One ``tidal bench`` row: random token-id prompts, ignore_eos; ``extra``: more bench flags."""
    prefix = Path(tempfile.mkdtemp(prefix="bench-serve-")) / "row"
    n = max(args.min_prompts, 2 * concurrency)
    subprocess.run([sys.executable, "-m", "tidal.cli", "bench", "--base-url", url, "--endpoint", "completions",
                    "--dataset", "random", "--prompt-format", "ids", "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--num-prompts", str(n), "--max-concurrency",
                    str(concurrency), "--warmup-requests", "1", "--output", str(prefix), "--no-plot",
                    "--no-progress", "--seed", str(concurrency), *extra], check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in Path(f"{prefix}.jsonl").read_text().splitlines() if line.strip()]
    return rows[-1]


def serve_rows(cmd: list[str], url: str, args: argparse.Namespace, vocab: int, log: Path,
               extra: list[str] = ()) -> dict[int, dict]:
    with open(log, "wb") as f:
        # llama-server in its own default OpenMP wait policy (see vs_llamacpp.run); tidal serve sets its own
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=tidal.foreign_process_env())
    try:
        wait_ready(url, proc)
        return {c: bench(url, c, args, vocab, list(extra)) for c in args.concurrency}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--min-prompts", type=int, default=4, help="prompts per row: max(this, 2 x concurrency)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server threads (tidal's core uses torch's default)")
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--skip-llamacpp", action="store_true")
    args = ap.parse_args(argv)
    model_dir = checkpoint(args.config)
    vocab = json.loads(args.config.read_text())["text_config"]["vocab_size"]
    step_ms, bound_ms = offline_step_ms(model_dir, vocab, args.input_len, args.output_len)
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-logs-"))
    pool = str(1 << 30)
    ctx = (args.input_len + args.output_len + 16) * max(args.concurrency)
    tidal_url = f"http://127.0.0.1:{args.port}"
    ours = serve_rows([sys.executable, "-m", "tidal.cli", "serve", str(model_dir), "--dtype", "bfloat16",
                       "--port", str(args.port), "--kv-cache-memory-bytes", pool, "--log-level", "warning",
                       "--no-access-log", "--stats-interval", "0"], tidal_url, args, vocab, logs / "tidal.log",
                      ["--extra-body", json.dumps({"logit_bias": TEXT_BIAS})])
    theirs: dict[int, dict] = {}
    if not args.skip_llamacpp:
        src, binary = llama_server_binary()
        path = gguf(src, model_dir, "bf16")
        llama_url = f"http://127.0.0.1:{args.port + 1}"
        theirs = serve_rows([str(binary), "-m", str(path), "-t", str(args.threads), "--port", str(args.port + 1),
                             "-c", str(ctx), "-np", str(max(args.concurrency)), "-b", "2048", "-ub", "512"],
                            llama_url, args, vocab, logs / "llama.log", ["--extra-body", json.dumps({"logit_bias": TEXT_BIAS})])
    itl = ours[1]["mean_itl_ms"] if 1 in ours else None
    print(f"\n## {args.config.name}, bf16, {args.input_len} in / {args.output_len} out, one run "
          f"(torch threads {torch.get_num_threads()}; logs in {logs})")
    print(f"offline decode step: {step_ms:.1f} ms; batch-1 bound (weights read / bandwidth): {bound_ms:.1f} ms")
    if itl is not None:
        print(f"tidal serve ITL at concurrency 1: {itl:.1f} ms = {itl / step_ms:.2f}x the offline step "
              f"(target <= 1.15); the bound is {bound_ms / itl:.0%} of it")
    print("\n| concurrency | tidal tok/s | tidal ITL ms | tidal TTFT ms | llama-server tok/s | llama ITL ms | "
          "llama TTFT ms | tidal / llama | failed (tidal, llama) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        a, b = ours[c], theirs.get(c)
        ratio = f"{a['output_throughput'] / b['output_throughput']:.2f}x" if b else "-"
        llama = (f"{b['output_throughput']:.1f} | {b['mean_itl_ms']:.1f} | {b['mean_ttft_ms']:.0f}" if b
                 else "- | - | -")
        print(f"| {c} | {a['output_throughput']:.1f} | {a['mean_itl_ms']:.1f} | {a['mean_ttft_ms']:.0f} | {llama} | "
              f"{ratio} | {a['failed']}, {b['failed'] if b else '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
