"""vLLM's `tests/utils.py`, as far as the entrypoint tests use it, pointed at `tidal serve`.

`RemoteOpenAIServer(model, vllm_serve_args)` starts one `tidal serve` process of the harness's
checkpoint (TIDAL_HARNESS_MODEL_DIR) under the test's model name, translating the vLLM flags
that tidal has and dropping the rest (each dropped flag is printed, so a failing test's log says
which vLLM option it relied on).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import requests

from vllm.utils.network_utils import get_open_port

# vLLM flags tidal serves under the same name (the value, if any, passes through).
KEPT_WITH_VALUE = {"--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--api-key",
                   "--host", "--port", "--served-model-name", "--limit-mm-per-prompt",
                   "--default-reasoning-effort", "--max-running-requests"}
KEPT_SWITCHES = {"--enable-prefix-caching", "--no-enable-prefix-caching"}
# vLLM flags that take no value (everything else that is dropped consumes the next argument
# when that argument is not itself a flag).
VLLM_SWITCHES = {"--enforce-eager", "--enable-auto-tool-choice", "--trust-remote-code",
                 "--enable-lora", "--enable-prompt-embeds", "--enable-mm-embeds",
                 "--enable-chunked-prefill", "--no-async-scheduling", "--enable-request-id-headers",
                 "--skip-tokenizer-init", "--return-tokens-as-token-ids", "--enable-sleep-mode",
                 "--enable-server-load-tracking", "--enable-prompt-tokens-details",
                 "--enable-force-include-usage", "--enable-tokenizer-info-endpoint",
                 "--exclude-tools-when-tool-choice-none", "--deterministic-prefix-caching",
                 "--enable-metrics", "--disable-log-requests", "--disable-log-stats",
                 "--disable-uvicorn-access-log"}
# vLLM switches passed on when this tidal serve has them (its --help is asked once).
PASSED_IF_SUPPORTED = {"--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
                       "--enable-force-include-usage"}
POOL = os.environ.get("TIDAL_HARNESS_POOL", "256MB")


def tidal_supports(flag: str) -> bool:
    return flag in _tidal_help()


def _tidal_help() -> str:
    global _HELP
    if _HELP is None:
        _HELP = subprocess.run([_python(), "-m", "tidal.cli", "serve", "--help"], capture_output=True,
                               text=True, cwd=_repo(), env=_env()).stdout
    return _HELP


_HELP: str | None = None


def _python() -> str:
    return os.environ.get("TIDAL_PYTHON", sys.executable)


def _repo() -> str:
    return os.environ.get("TIDAL_REPO", str(Path.cwd()))


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.update(extra or {})
    return env


def translate_args(args: list[str]) -> tuple[list[str], list[str]]:
    """vLLM serve flags -> (tidal serve flags, the dropped vLLM flags)."""
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, inline = arg.partition("=")
        if flag in KEPT_WITH_VALUE:
            if eq:
                kept.append(arg)
                i += 1
            else:
                kept += args[i:i + 2]
                i += 2
            # vLLM takes several names after --served-model-name
            while flag == "--served-model-name" and i < len(args) and not args[i].startswith("--"):
                kept.append(args[i])
                i += 1
            continue
        if flag in KEPT_SWITCHES or (flag in PASSED_IF_SUPPORTED and tidal_supports(flag)):
            kept.append(flag)
            i += 1
            continue
        if flag in VLLM_SWITCHES or eq or i + 1 >= len(args) or args[i + 1].startswith("--"):
            dropped.append(arg)
            i += 1
        else:
            dropped.append(f"{arg} {args[i + 1]}")
            i += 2
    return kept, dropped


class RemoteOpenAIServer:
    """A live `tidal serve` on 127.0.0.1 with vLLM's RemoteOpenAIServer interface."""

    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict[str, Any] | None = None) -> None:
        if auto_port and ("-p" in vllm_serve_args or "--port" in vllm_serve_args):
            raise ValueError("You have manually specified the port when `auto_port=True`.")
        args, dropped = translate_args(list(vllm_serve_args))
        if "--model" in args:
            raise ValueError("--model is not a tidal flag")
        if auto_port:
            args += ["--port", str(get_open_port())]
        if "--served-model-name" not in args:
            args += ["--served-model-name", model]
        # vLLM without --reasoning-parser does not split thinking from the answer: the tests then
        # expect every token in `content`. tidal's equivalent is a server that does not think.
        if not any(a.startswith("--reasoning-parser") for a in vllm_serve_args) \
                and "--default-reasoning-effort" not in args:
            args += ["--default-reasoning-effort", "none"]
        self.host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
        self.port = int(args[args.index("--port") + 1])
        self.uds = None
        self.show_hidden_metrics = False
        cmd = [_python(), "-m", "tidal.cli", "serve", os.environ["TIDAL_HARNESS_MODEL_DIR"],
               "--kv-cache-memory-bytes", POOL, "--stats-interval", "0", *args]
        print(f"[harness] {model}: {' '.join(cmd)}")
        if dropped:
            print(f"[harness] vLLM flags tidal does not take (dropped): {' '.join(dropped)}")
        self.proc = subprocess.Popen(cmd, env=_env(env_dict), cwd=_repo(), stdout=sys.stdout,
                                     stderr=sys.stderr, start_new_session=True)
        try:
            self._wait_for_server(url=self.url_for("health"), timeout=max_wait_seconds or 240)
        except Exception:
            self._shutdown()
            raise

    def _wait_for_server(self, *, url: str, timeout: float) -> None:
        start = time.time()
        while True:
            try:
                if requests.get(url, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"Server exited unexpectedly (rc {self.proc.returncode}).")
            if time.time() - start > timeout:
                raise RuntimeError("Server failed to start in time.")
            time.sleep(0.3)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)

    def get_client_anthropic(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return anthropic.Anthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client_anthropic(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return anthropic.AsyncAnthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0,
                                        **kwargs)


RemoteOpenAIServerCustom = RemoteOpenAIServer
ROCM_ENV_OVERRIDES: dict[str, str] = {}
ROCM_EXTRA_ARGS: list[str] = []


def _gpu_only(*args, **kwargs):
    import pytest

    return pytest.mark.skip(reason="needs a GPU feature of vLLM's")


multi_gpu_only = requires_fp8 = _gpu_only
