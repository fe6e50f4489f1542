"""A stand-in for the `vllm` package, so that vLLM's entrypoint tests import without vLLM.

The tests talk to a live `tidal serve` over HTTP; the few names they import from vLLM are either
given a real meaning here (the tokenizer, the version string, a free port) or stand for vLLM
internals. Such an internal is a placeholder class: importing it works, using it raises, so a
test that exercises vLLM's Python objects fails (and the harness skips those with a reason).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class VllmInternal:
    """A vLLM-internal name; the harness serves tidal over HTTP and has none of them."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError(f"{type(self).__qualname__} is a vLLM internal, not available against tidal")


def _placeholder(module: str, name: str) -> type:
    return type(name, (VllmInternal,), {"__module__": module, "__qualname__": f"{module}.{name}"})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(self.__name__, name)
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so deeper imports resolve too
        return module

    def exec_module(self, module) -> None:
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    """Any `vllm.*` module not written out in this folder is a stub module."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("vllm."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())

__version__ = "0.0.0+tidal-harness"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(__name__, name)
