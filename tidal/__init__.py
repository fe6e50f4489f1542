"""tidal: an inference and serving engine for Kimi-K3-class hybrid models."""

from __future__ import annotations

import os

# OpenMP threads (torch's pool and tidal's C kernels share one libgomp) wait passively, so a step on
# a CPU shared with other work slows in proportion to the CPU it gets instead of spinning at every
# barrier against the other processes. libgomp reads this when torch loads it: import tidal first
# (the CLI does); OMP_WAIT_POLICY=active in the environment overrides it.
# The caller's own setting (None when unset) is kept for child processes that are not tidal: children
# inherit the environment, and a program with its own barriers on libgomp (llama.cpp's ggml) would
# otherwise run under tidal's choice instead of its own default.
CALLER_OMP_WAIT_POLICY: str | None = os.environ.get("OMP_WAIT_POLICY")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def foreign_process_env() -> dict[str, str]:
    """The environment for a child process that is not tidal: this one's, with OMP_WAIT_POLICY as the
    caller had it before tidal set its default."""
    env = dict(os.environ)
    if CALLER_OMP_WAIT_POLICY is None:
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = CALLER_OMP_WAIT_POLICY
    return env

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `import tidal` stays cheap for the CLI and for tools that only need the config.
    if name == "LLM":
        from tidal.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tidal.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
