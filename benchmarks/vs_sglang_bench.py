"""``tidal bench --endpoint chat`` beside SGLang's own ``bench_serving`` client, same server, same load.

    python benchmarks/vs_sglang_bench.py [--num-prompts 24] [--input-len 128] [--output-len 64]
                                         [--concurrency 4] [--rounds 1] [--model-dir DIR]

Starts ``tidal serve`` (the embedded model unless --model-dir) on 127.0.0.1 once, then runs the
two clients one after the other, ``--rounds`` times, on the same load: N chat requests of fixed
input/output length (ignore_eos, temperature 0), a closed loop of C at a time, thinking off
(``reasoning_effort: none``, so every streamed token is ``content``, the only text SGLang 0.5.5's
chat client times). Prints mean / median / p99 ITL, TTFT and output throughput of each client,
the ratios tidal/SGLang, and whether mean and p99 ITL agree within 15%.

SGLang's client is its released ``sglang/bench_serving.py`` (SGLANG_VERSION, the last release
where the client is one file that imports no other part of SGLang), taken out of the wheel and
run as a script in a venv of its own: tidal's environment underneath (so the pinned torch is the
one pip sees) plus aiohttp, datasets and pybase64, pinned. Nothing of SGLang is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve_prefix import serve  # noqa: E402 - the same server start-up as the prefix benchmark

SGLANG_VERSION = "0.5.5"
CLIENT_DEPS = ["aiohttp==3.14.5", "datasets==5.2.0", "pybase64==1.5.1"]
NO_THINKING = {"reasoning_effort": "none"}
TOLERANCE = 0.15
REPO = Path(__file__).resolve().parent.parent
EMBEDDED = REPO / "tidal" / "assets" / "embedded"


def sglang_client(work: Path) -> tuple[Path, Path]:
    """(python of the client's venv, bench_serving.py), made once under ``work``."""
    venv = work / "venv"
    script = work / f"sglang_{SGLANG_VERSION}_bench_serving.py"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
        Path(own, "zz_tidal_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run([str(python), "-m", "pip", "install", "-q", *CLIENT_DEPS], check=True)
    if not script.exists():
        wheels = work / "wheel"
        subprocess.run([str(python), "-m", "pip", "download", "-q", "--no-deps", f"sglang=={SGLANG_VERSION}",
                        "-d", str(wheels)], check=True)
        wheel = next(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            script.write_bytes(z.read("sglang/bench_serving.py"))
    return python, script


def run_tidal(args: argparse.Namespace, url: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tidal.cli", "bench", "--base-url", url, "--endpoint", "chat",
           "--dataset", "random", "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
           "--tokenizer", str(args.model_dir), "--seed", "1", "--warmup-requests", "1", "--temperature", "0",
           "--extra-body", json.dumps(NO_THINKING), "--output", str(out), "--no-plot", "--no-progress"]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(out.with_suffix(".jsonl").read_text().splitlines()[-1])


def run_sglang(args: argparse.Namespace, url: str, python: Path, script: Path, out: Path) -> dict:
    out.unlink(missing_ok=True)
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    cmd = [str(python), str(script), "--backend", "sglang-oai-chat", "--base-url", url, "--model", model,
           "--tokenizer", str(args.model_dir), "--dataset-name", "random-ids",
           "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "1",
           "--max-concurrency", str(args.concurrency), "--seed", "1", "--warmup-requests", "1",
           "--extra-request-body", json.dumps(NO_THINKING), "--output-file", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text().splitlines()[-1])


KEYS = [("mean_itl_ms", "mean ITL ms"), ("median_itl_ms", "median ITL ms"), ("p99_itl_ms", "p99 ITL ms"),
        ("mean_ttft_ms", "mean TTFT ms"), ("output_throughput", "output tok/s"),
        ("completed", "completed"), ("total_input_tokens", "input tokens"),
        ("total_output_tokens", "output tokens")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="alternate the two clients this many times")
    p.add_argument("--model-dir", type=Path, default=EMBEDDED)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tidal-vs-sglang-bench")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    python, script = sglang_client(args.work)
    proc, url = serve(str(args.model_dir), True, args.work / "serve.log")
    rows: dict[str, list[dict]] = {"tidal": [], "sglang": []}
    try:
        for r in range(args.rounds):
            rows["tidal"].append(run_tidal(args, url, args.work / f"tidal-{r}"))
            rows["sglang"].append(run_sglang(args, url, python, script, args.work / f"sglang-{r}.jsonl"))
    finally:
        proc.terminate()
        proc.wait(30)
    mean = {k: {key: sum(float(row[key]) for row in v) / len(v) for key, _ in KEYS} for k, v in rows.items()}
    print(f"same tidal serve ({args.model_dir.name}), {args.num_prompts} chat requests of {args.input_len} in / "
          f"{args.output_len} out, concurrency {args.concurrency}, thinking off, {args.rounds} round(s)")
    print(f"{'':16}{'tidal bench':>14}{'SGLang ' + SGLANG_VERSION:>14}{'tidal/SGLang':>14}")
    for key, label in KEYS:
        t, s = mean["tidal"][key], mean["sglang"][key]
        print(f"{label:16}{t:14.2f}{s:14.2f}{(t / s if s else float('nan')):14.3f}")
    ok = all(abs(mean["tidal"][k] / mean["sglang"][k] - 1) <= TOLERANCE for k in ("mean_itl_ms", "p99_itl_ms"))
    print(f"mean and p99 ITL within {TOLERANCE:.0%}: {'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
