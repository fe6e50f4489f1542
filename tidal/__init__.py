"""tidal: an inference and serving engine for Kimi-K3-class hybrid models."""

from __future__ import annotations

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
