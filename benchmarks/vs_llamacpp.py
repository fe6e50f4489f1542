"""tidal's offline engine against llama.cpp on the CPU, same K3-layout checkpoint, one command.

    python benchmarks/vs_llamacpp.py                 # the 223M model (benchmarks/configs/k3-223m.json)
    python benchmarks/vs_llamacpp.py --threads 2 --trunks bf16 --skip-busy

llama.cpp is built from the llama-cpp-python 0.3.36 sdist (``pip download --no-binary :all:``; cmake;
cached under ~/.cache/tidal/llamacpp; nothing of it is committed). The checkpoint (random weights,
MXFP4 experts, a synthetic byte-level tokenizer) is converted with its ``convert_hf_to_gguf.py``
(--outtype bf16 / f32; the unknown pre-tokenizer hash is answered ``kimi-k2``).

Measured as issue 15 defines it, 2 threads: prefill = llama-bench pp512 against one 512-token prompt;
decode = llama-batched-bench S_TG at B = 1 / 8 / 32 sequences of 128 prompt + 128 generated tokens
against tidal's (B x 128) / (t(129 tokens) - t(1 token)) on B random 128-token prompts; "busy" = the
B = 1 decode again while two busy-looping processes hold the cores; resident weights = the bytes of
tidal's model tensors (shared storage once) against the GGUF file. Also the batch-1 bound: weight
bytes read per token / the rate of a read stream of that many bytes, re-read as a decode step re-reads
them (caches included: a working set the last-level cache holds reads faster than DRAM; the rate of a
stream past that cache is printed beside it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from contextlib import contextmanager
from pathlib import Path

import tidal  # first: its OpenMP wait policy must be set before torch loads libgomp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import active_weight_bytes, read_bandwidth  # noqa: E402

from tidal import LLM, SamplingParams  # noqa: E402
from tidal.config import ModelConfig  # noqa: E402
from tidal.embedded import write_byte_tokenizer  # noqa: E402
from tidal.model.checkpoint import MXFP4, save_model  # noqa: E402
from tidal.model.init import init_weights  # noqa: E402
from tidal.model.kimi import KimiForCausalLM  # noqa: E402

VERSION = "0.3.36"
CACHE = Path(os.environ.get("TIDAL_CACHE_DIR", Path.home() / ".cache" / "tidal"))
LLAMA = CACHE / "llamacpp"
CONFIG = Path(__file__).resolve().parent / "configs" / "k3-223m.json"
BUSY = "while True: pass"
DRAM_STREAM = 1 << 30  # bytes of a read stream larger than the last-level cache
TOOLS = ("llama-bench", "llama-batched-bench")

# convert_hf_to_gguf.py with our synthetic tokenizer: its hash is unknown to llama.cpp, answered kimi-k2.
CONVERT = """
import runpy, sys
src = sys.argv.pop(1)
sys.path.insert(0, src + "/gguf-py"); sys.path.insert(0, src)
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "kimi-k2"
TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(cmd: list[str], **kw) -> str:
    """Run a command that is not tidal (llama.cpp's tools, cmake, pip) in its own default OpenMP wait
    policy: under the PASSIVE that importing tidal sets, every one of ggml's OpenMP barriers sleeps and
    wakes, which slows llama.cpp's decode several-fold and is not how llama.cpp runs."""
    kw.setdefault("env", tidal.foreign_process_env())
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def build_llamacpp() -> tuple[Path, Path]:
    """(llama.cpp source dir, bin dir), building once into the cache."""
    src = LLAMA / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    bins = LLAMA / "build" / "bin"
    if all((bins / t).exists() for t in TOOLS):
        return src, bins
    LLAMA.mkdir(parents=True, exist_ok=True)
    sdist = LLAMA / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(LLAMA),
             f"llama-cpp-python=={VERSION}"])
    if not src.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(LLAMA, filter="data")
    print(f"building llama.cpp into {LLAMA / 'build'} (several minutes)", flush=True)
    run(["nice", "cmake", "-S", str(src), "-B", str(LLAMA / "build"), "-DCMAKE_BUILD_TYPE=Release",
         "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"])
    run(["nice", "cmake", "--build", str(LLAMA / "build"), f"-j{os.cpu_count()}", "--target", *TOOLS])
    return src, bins


def checkpoint(config_path: Path) -> Path:
    """The random-weight checkpoint (bf16 trunk, MXFP4 experts, byte tokenizer), cached by config."""
    text = config_path.read_text()
    out = CACHE / "vs_llamacpp" / f"k3-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists():
        return out
    config = ModelConfig.from_dict(json.loads(text))
    model = init_weights(KimiForCausalLM(config), seed=0).to_dtype(torch.bfloat16)
    save_model(model, out, expert_format=MXFP4)
    write_byte_tokenizer(out)
    return out


def gguf(src: Path, model_dir: Path, outtype: str) -> Path:
    path = model_dir / f"model-{outtype}.gguf"
    if not path.exists():
        run([sys.executable, "-c", CONVERT, str(src), str(model_dir), "--outtype", outtype, "--outfile", str(path)])
    return path


@contextmanager
def busy(n: int):
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    try:
        time.sleep(0.5)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def llama_pp512(bins: Path, model: Path, threads: int) -> float:
    rows = json.loads(run([str(bins / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "512", "-n", "0",
                           "-r", "2", "-o", "json"]))
    return float(rows[0]["avg_ts"])


def llama_decode(bins: Path, model: Path, threads: int, batches: list[int]) -> dict[int, float]:
    """S_TG of llama-batched-bench at each B, 128 prompt + 128 generated tokens."""
    ctx = 256 * max(batches)
    out = run([str(bins / "llama-batched-bench"), "-m", str(model), "-t", str(threads), "-c", str(ctx), "-b", "2048",
               "-ub", "512", "-npp", "128", "-ntg", "128", "-npl", ",".join(map(str, batches)),
               "--output-format", "jsonl"])
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {int(r["pl"]): float(r["speed_tg"]) for r in rows}


def prompts(vocab: int, count: int, length: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": p} for p in torch.randint(0, min(vocab, 250), (count, length), generator=g).tolist()]


def timed(llm: LLM, batch: list[dict], tokens: int) -> float:
    t0 = time.perf_counter()
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return time.perf_counter() - t0


def tidal_prefill(llm: LLM, vocab: int) -> float:
    one = prompts(vocab, 1, 512, seed=512)
    return 512 / min(timed(llm, one, 1) for _ in range(2))


def tidal_decode(llm: LLM, vocab: int, b: int) -> float:
    batch = prompts(vocab, b, 128, seed=b)
    t1 = min(timed(llm, batch, 1) for _ in range(2))
    t129 = timed(llm, batch, 129)
    return b * 128 / (t129 - t1)


def resident_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trunks", nargs="+", default=["bf16", "f32"], choices=["bf16", "f32"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--skip-busy", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true", help="tidal's rows only")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = checkpoint(args.config)
    src, bins = (None, None) if args.skip_llamacpp else build_llamacpp()
    vocab = json.loads(args.config.read_text())["text_config"]["vocab_size"]
    rows: dict[str, dict[str, float]] = {}
    sizes: dict[str, tuple[int, int]] = {}
    bound = ""
    for trunk in args.trunks:
        r: dict[str, float] = {}
        llm = LLM(str(model_dir), dtype="bfloat16" if trunk == "bf16" else "float32", skip_tokenizer_init=True,
                  kv_cache_memory_bytes=1 << 30, max_num_batched_tokens=2048)
        timed(llm, prompts(vocab, 2, 16, seed=0), 4)  # warm-up: kernels built, pool touched
        r["tidal prefill"] = tidal_prefill(llm, vocab)
        for b in args.batches:
            r[f"tidal decode {b}"] = tidal_decode(llm, vocab, b)
        if not args.skip_busy:
            with busy(2):
                r["tidal busy"] = tidal_decode(llm, vocab, 1)
        if trunk == args.trunks[0] and 1 in args.batches:
            per_tok = active_weight_bytes(llm.engine.model)
            bw, dram = read_bandwidth(per_tok), read_bandwidth(DRAM_STREAM)
            limit = bw / per_tok
            got = r["tidal decode 1"]
            bound = (f"batch-1 bound ({trunk}): {per_tok / 1e6:.1f} MB of weights read per token / {bw / 1e9:.1f} GB/s "
                     f"(a read stream of those bytes, re-read) = {limit:.0f} tok/s; tidal {got:.0f} tok/s = "
                     f"{got / limit:.0%} of it (a {DRAM_STREAM >> 30} GiB stream, past the last-level cache: "
                     f"{dram / 1e9:.1f} GB/s)")
        if bins is not None:
            path = gguf(src, model_dir, trunk)
            r["llama prefill"] = llama_pp512(bins, path, args.threads)
            for b, v in llama_decode(bins, path, args.threads, args.batches).items():
                r[f"llama decode {b}"] = v
            if not args.skip_busy:
                with busy(2):
                    r["llama busy"] = llama_decode(bins, path, args.threads, [1])[1]
            sizes[trunk] = (resident_bytes(llm.engine.model), path.stat().st_size)
        rows[trunk] = r
        del llm
    print(f"\n## {args.config.name}, {args.threads} threads, one run (ratios are the figures to read)")
    head = "| | " + " | ".join(f"llama.cpp {t} | tidal {t} | ratio" for t in args.trunks) + " |"
    print(head)
    print("|---" * (1 + 3 * len(args.trunks)) + "|")
    labels = [("prefill 512 tokens", "prefill")] + [(f"decode, {b} sequence(s)", f"decode {b}") for b in args.batches]
    if not args.skip_busy:
        labels.append(("decode, 1 sequence, 2 busy processes", "busy"))
    for label, key in labels:
        cells = []
        for t in args.trunks:
            ours, theirs = rows[t].get(f"tidal {key}"), rows[t].get(f"llama {key}")
            ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
            cells.append(f"{theirs:.0f} | {ours:.0f} | {ratio}" if theirs else f"- | {ours:.0f} | -")
        print(f"| {label} | " + " | ".join(cells) + " |")
    for t, (ours, theirs) in sizes.items():
        print(f"resident weights ({t}): tidal {ours / 1e6:.1f} MB, GGUF {theirs / 1e6:.1f} MB = {ours / theirs:.2f}x")
    print(bound)
    return 0


if __name__ == "__main__":
    sys.exit(main())
