"""`tidal plan` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tidal.config import ConfigError, ModelConfig
from tidal.plan.layout import (
    DEFAULT_PAGE_SIZE,
    DEFAULT_RESERVE_BYTES,
    GIB,
    KV_DTYPE_BYTES,
    PUBLISHED_A_LOG_VALUES,
    SGLANG_DEFAULT_RATIO,
    SGLANG_DEFAULT_SLOTS_PER_REQUEST,
    PlanError,
)
from tidal.plan.planner import plan
from tidal.plan.report import plan_table, plan_to_json
from tidal.plan.sglang import Workload

# ---- command line --------------------------------------------------------------------------------


def load_model(spec: str) -> tuple[str, ModelConfig, int | None]:
    """PRESET, config.json or model directory -> (name, config, on-disk A_log count if known)."""
    from tidal.presets import PRESET_FILES, preset

    if spec in PRESET_FILES:
        return spec, preset(spec), PUBLISHED_A_LOG_VALUES.get(spec)
    path = Path(spec)
    if not path.exists():
        raise PlanError(f"--model {spec!r} is neither a preset ({', '.join(PRESET_FILES)}) nor a path")
    return path.name if path.is_dir() else str(path), ModelConfig.from_file(path), None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tidal plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="preset (kimi-k3, kimi-linear-48b), config.json or model dir")
    ap.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="memory of one GPU in GiB")
    ap.add_argument("--num-gpus", type=int, default=None, help="GPUs (default: --tp-size)")
    ap.add_argument("--tp-size", type=int, default=None, help="tensor parallel size (default: --num-gpus, else 1)")
    ap.add_argument("--dcp-size", type=int, default=1, help="decode context parallel size (divides --tp-size)")
    ap.add_argument("--ep-size", type=int, default=1, help="expert parallel size (divides --tp-size)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.9)
    ap.add_argument("--reserve-gib", type=float, default=DEFAULT_RESERVE_BYTES / GIB,
                    help="workspace kept out of the pool inside the static fraction")
    ap.add_argument("--kv-dtype", choices=tuple(KV_DTYPE_BYTES), default="bf16")
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    ap.add_argument("--spec-draft-tokens", type=int, default=0, metavar="K")
    ap.add_argument("--workload", default=None, help='"isl=8192,osl=1024,concurrency=50"')
    ap.add_argument("--engine", choices=("tidal", "sglang"), default="tidal")
    ap.add_argument("--mamba-full-memory-ratio", type=float, default=SGLANG_DEFAULT_RATIO, metavar="R")
    ap.add_argument("--sglang-slots-per-request", type=int, default=SGLANG_DEFAULT_SLOTS_PER_REQUEST,
                    help="1: radix cache off; 3: default; 5: extra_buffer with overlap")
    ap.add_argument("--max-running-requests", type=int, default=None, help="cap on running requests: tidal serve's flag of that name, and SGLang's (default: "
                         "none for tidal, SGLang's own rule for SGLang)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tp_size is None:
        args.tp_size = args.num_gpus or 1
    try:
        name, config, a_log = load_model(args.model)
        p = plan(
            config,
            gpu_memory_gib=args.gpu_memory,
            tp_size=args.tp_size,
            dcp_size=args.dcp_size,
            ep_size=args.ep_size,
            num_gpus=args.num_gpus,
            mem_fraction_static=args.mem_fraction_static,
            reserve_bytes=int(args.reserve_gib * GIB),
            model=name,
            a_log_values=a_log,
            kv_dtype=args.kv_dtype,
            page_size=args.page_size,
            spec_draft_tokens=args.spec_draft_tokens,
            workload=Workload.parse(args.workload) if args.workload else None,
            engine=args.engine,
            mamba_full_memory_ratio=args.mamba_full_memory_ratio,
            slots_per_request=args.sglang_slots_per_request,
            max_running_requests=args.max_running_requests,
        )
    except (PlanError, ConfigError) as e:
        if args.json:
            print(json.dumps({"error": str(e)}))
        print(f"tidal plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_to_json(p), indent=2) if args.json else plan_table(p), end="" if not args.json else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
