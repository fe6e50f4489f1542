"""``tidal quantize SRC DST``: rewrite a checkpoint with its routed experts in MXFP4.

Works for any fp32 / bf16 checkpoint tidal reads (dense or already-MXFP4 experts): the weights are
loaded in float32, routed experts are quantised per the OCP MX spec (E2M1 elements, E8M0 scale per
block of 32, round-to-nearest-even, saturating) into the compressed-tensors
``mxfp4-pack-quantized`` layout, and the trunk is written in ``--dtype``. Tokenizer files travel along.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from tidal.config import parse_dtype

# Non-weight files of a checkpoint directory that describe how to use it.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja")


def quantize_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Load ``src``, write ``dst`` with MXFP4 routed experts and the trunk in ``dtype``."""
    from tidal.model.checkpoint import MXFP4, load_model, save_model

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("SRC and DST must differ (DST's model files are replaced)")
    model = load_model(src, torch.float32)
    if not model.config.num_experts:
        raise ValueError(f"{src} has no routed experts to quantise")
    save_model(model, dst, expert_format=MXFP4, dtype=dtype)
    for name in COMPANION_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tidal quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", help="output directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="trunk dtype on disk")
    args = p.parse_args(argv)
    try:
        out = quantize_checkpoint(args.src, args.dst, parse_dtype(args.dtype))
    except (ValueError, OSError) as e:
        print(f"tidal quantize: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
