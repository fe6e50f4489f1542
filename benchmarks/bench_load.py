"""Checkpoint load speed against reading the same files with ``cat``, in one command.

    python benchmarks/bench_load.py --size-gb 1

Writes a random Kimi Linear-layout checkpoint of about --size-gb (bf16, sharded), then times
``cat shards > /dev/null`` and ``load_model`` on the same files, each after dropping the page cache
when the machine allows it (else both warm), and prints GB/s and the ratio.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tidal.config import ModelConfig
from tidal.model.checkpoint import load_model, save_model
from tidal.model.kimi import KimiForCausalLM
from tidal.presets import tiny_kimi_linear_dict


def big_config(size_gb: float) -> ModelConfig:
    d = tiny_kimi_linear_dict(hidden_size=1024, num_layers=8, vocab_size=32000, num_experts=16, top_k=2)
    d.update(intermediate_size=4096, moe_intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, torch_dtype="bfloat16")
    d["linear_attn_config"].update(num_heads=8, head_dim=128)
    # grow the expert count until the bf16 size reaches the target
    per_expert_layer = 3 * 1024 * 512 * 2 * (d["num_hidden_layers"] - 1)
    base = sum(p.numel() for p in KimiForCausalLM(ModelConfig.from_dict({**d, "num_experts": 2})).parameters()) * 2
    d["num_experts"] = max(2, int((size_gb * 1e9 - base) / per_expert_layer) + 2)
    return ModelConfig.from_dict(d)


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    config = big_config(args.size_gb)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = Path(tmp) / "ckpt"
        with torch.device("meta"):
            meta = KimiForCausalLM(config)
        model = meta.to_empty(device="cpu")
        for p in model.parameters():
            p.data.normal_(0, 0.02)
        save_model(model.to_dtype(torch.bfloat16), out, max_shard_bytes=256 << 20)
        del model, meta
        files = sorted(out.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        print(f"checkpoint: {len(files)} shards, {size / 1e9:.2f} GB")
        for _ in range(2):  # the second round is reported (first one warms allocators)
            cold = drop_caches()
            t0 = time.perf_counter()
            subprocess.run(["sh", "-c", "cat \"$@\" > /dev/null", "cat", *map(str, files)], check=True)
            t_cat = time.perf_counter() - t0
            drop_caches()
            t0 = time.perf_counter()
            loaded = load_model(out, dtype=torch.bfloat16)
            t_load = time.perf_counter() - t0
            del loaded
        state = "cold page cache" if cold else "warm page cache (could not drop caches)"
        print(f"[{state}] cat: {size / t_cat / 1e9:.2f} GB/s ({t_cat:.2f} s)   "
              f"load_model: {size / t_load / 1e9:.2f} GB/s ({t_load:.2f} s)   ratio load/cat = {t_cat / t_load:.2f}")


if __name__ == "__main__":
    main()
