"""The ``tidal`` command. Each subcommand lives in its own module, which owns its arguments."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("tidal.generate", "generate text offline with the embedded model or a checkpoint"),
    "serve": ("tidal.serve.cli", "OpenAI- and Anthropic-compatible server (the embedded model by default)"),
    "bench": ("tidal.bench.cli", "serving benchmark for any OpenAI-compatible server"),
    "plan": ("tidal.plan", "memory planner: weights, KDA state and MLA KV per rank, capacities"),
    "train": ("tidal.train.cli", "train a small K3-architecture model on CPU (the embedded default)"),
    "quantize": ("tidal.train.quantize", "write a checkpoint's routed experts in MXFP4 (compressed-tensors)"),
}


def usage() -> str:
    lines = ["usage: tidal <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\n'tidal <command> --help' for a command's options")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"tidal: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
