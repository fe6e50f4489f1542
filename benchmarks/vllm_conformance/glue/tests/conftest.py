"""The harness's root conftest: which of vLLM's entrypoint tests apply to tidal, and why not.

Three kinds of skip, each with its reason in the report:
- whole files (`SKIPPED_FILES`): model-specific, LoRA, multimodal, vLLM-only endpoints or flags,
  or unit tests of vLLM's Python internals; they are not even imported;
- single tests (`SKIPPED_TESTS`), by file and name prefix, for the same reasons;
- any test of an applying file that starts no server: such a test checks vLLM's Python objects
  (request classes, mocks of its serving layer), which tidal does not have.
LoRA parametrizations (a model name containing "lora") are skipped: tidal serves no adapters.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from pathlib import Path

import pytest

MODEL_SPECIFIC = "model-specific (a particular checkpoint's chat template, parser or accuracy)"
MULTIMODAL = "multimodal with a specific vision/audio checkpoint or network-fetched media"
LORA = "LoRA adapters (tidal serves none)"
INTERNALS = "unit tests of vLLM's Python internals, no server"
VLLM_ONLY = "a vLLM-only endpoint, CLI or server mode"

SKIPPED_FILES: dict[str, str] = {
    "anthropic/test_anthropic_messages_conversion.py": INTERNALS,
    "openai/chat_completion/test_audio.py": MULTIMODAL,
    "openai/chat_completion/test_audio_in_video.py": MULTIMODAL,
    "openai/chat_completion/test_chat_completion_with_mixed_audio_embeds.py": MULTIMODAL,
    "openai/chat_completion/test_chat_completion_with_mixed_image_embeds.py": MULTIMODAL,
    "openai/chat_completion/test_chat_completion_with_prompt_embeds.py": VLLM_ONLY + " (prompt embeds)",
    "openai/chat_completion/test_chat_error.py": INTERNALS,
    "openai/chat_completion/test_chat_with_tool_reasoning.py": MODEL_SPECIFIC + " (QwQ deepseek_r1 parser)",
    "openai/chat_completion/test_completion_with_image_embeds.py": MULTIMODAL,
    "openai/chat_completion/test_default_mm_loras.py": LORA,
    "openai/chat_completion/test_oot_registration.py": VLLM_ONLY + " (out-of-tree model registration)",
    "openai/chat_completion/test_serving_chat.py": INTERNALS,
    "openai/chat_completion/test_serving_chat_stream_harmony.py": INTERNALS,
    "openai/chat_completion/test_thinking_token_budget.py": MODEL_SPECIFIC + " (Qwen3 think tags)",
    "openai/chat_completion/test_video.py": MULTIMODAL,
    "openai/chat_completion/test_vision.py": MULTIMODAL,
    "openai/chat_completion/test_vision_embeds.py": MULTIMODAL,
    "openai/completion/test_completion_error.py": INTERNALS,
    "openai/completion/test_completion_with_prompt_embeds.py": VLLM_ONLY + " (prompt embeds)",
    "openai/completion/test_lora_resolvers.py": LORA,
    "openai/completion/test_shutdown.py": VLLM_ONLY + " (engine-core process tree and --shutdown-timeout)",
    "openai/completion/test_tensorizer_entrypoint.py": VLLM_ONLY + " (tensorizer load format)",
    "openai/completion/test_token_in_token_out.py": VLLM_ONLY + " (--skip-tokenizer-init, HF weight download)",
    "openai/correctness/test_lmeval.py": MODEL_SPECIFIC + " (GSM8K accuracy of Qwen2-1.5B)",
    "openai/generative_scoring": VLLM_ONLY + " (generative scoring)",
    "openai/parser": INTERNALS + " (gpt-oss Harmony)",
    "openai/responses/test_harmony.py": MODEL_SPECIFIC + " (gpt-oss Harmony)",
    "openai/responses/test_harmony_utils.py": INTERNALS,
    "openai/responses/test_function_call_parsing.py": INTERNALS,
    "openai/responses/test_image.py": MULTIMODAL,
    "openai/responses/test_mcp_tools.py": MODEL_SPECIFIC + " (gpt-oss MCP tool server)",
    "openai/responses/test_parsable_context.py": MODEL_SPECIFIC + " (Qwen3-8B with a tool server)",
    "openai/responses/test_protocol.py": INTERNALS,
    "openai/responses/test_response_input_to_harmony.py": INTERNALS,
    "openai/responses/test_responses_utils.py": INTERNALS,
    "openai/responses/test_sampling_params.py": INTERNALS,
    "openai/responses/test_serving_responses.py": INTERNALS,
    "openai/test_cli_args.py": INTERNALS,
    "openai/test_fingerprint.py": INTERNALS,
    "openai/test_mm_serde.py": INTERNALS,
    "openai/test_multi_api_servers.py": VLLM_ONLY + " (--api-server-count)",
    "openai/test_openai_schema.py": VLLM_ONLY + " (schemathesis over vLLM's own OpenAPI document, SmolVLM)",
    "openai/test_run_batch.py": VLLM_ONLY + " (vllm run-batch)",
    "openai/test_tool_calls_serialization.py": INTERNALS,
    "openai/test_tool_choice_content_none.py": INTERNALS,
    "openai/tool_parsers": MODEL_SPECIFIC + " (granite4/hermes/gpt-oss tool parsers)",
    "serve/disagg": VLLM_ONLY + " (disaggregated /inference/v1/generate)",
    "serve/instrumentator/test_optional_middleware.py": VLLM_ONLY + " (--middleware, embedding model)",
    "serve/instrumentator/test_orca_metrics.py": VLLM_ONLY + " (ORCA endpoint-load-metrics header)",
    "serve/instrumentator/test_sleep.py": VLLM_ONLY + " (sleep mode)",
    "serve/lora": LORA,
    "serve/render": VLLM_ONLY + " (vllm launch render)",
    "serve/tokenize/test_serving_tokenization.py": INTERNALS,
    "serve/tokenize/test_tokenization_vlm.py": MULTIMODAL,
    "serve/tokenize/test_tokenize_then_chat_vlm.py": MULTIMODAL,
}

# (file, test-name prefix) -> reason, inside files that otherwise apply.
SKIPPED_TESTS: dict[tuple[str, str], str] = {
    ("openai/completion/test_prompt_validation.py", "test_load_prompt_embeds"): INTERNALS,
    ("openai/completion/test_prompt_validation.py", "test_disable_prompt_embeds"): INTERNALS,
    ("openai/completion/test_prompt_validation.py", "test_empty_prompt_embeds"): VLLM_ONLY + " (prompt embeds)",
    ("serve/instrumentator/test_basic.py", "test_health_check_engine_dead_error"): INTERNALS,
}

ENTRYPOINTS = Path(__file__).parent / "entrypoints"


def _relative(path: Path) -> str | None:
    try:
        return path.resolve().relative_to(ENTRYPOINTS.resolve()).as_posix()
    except ValueError:
        return None


def file_skip_reason(rel: str) -> str | None:
    for prefix, reason in SKIPPED_FILES.items():
        if rel == prefix or rel.startswith(prefix.rstrip("/") + "/"):
            return reason
    return None


_IGNORED: dict[str, str] = {}


def pytest_ignore_collect(collection_path: Path, config):
    rel = _relative(collection_path)
    if rel is None or not rel.endswith(".py") or not Path(rel).name.startswith("test_"):
        return None
    reason = file_skip_reason(rel)
    if reason is not None:
        _IGNORED[rel] = reason
        return True
    return None


def _starts_a_server(item: pytest.Item) -> bool:
    if any("server" in name or "client" in name for name in item.fixturenames):
        return True
    try:
        return "RemoteOpenAIServer" in inspect.getsource(item.function)
    except (OSError, TypeError, AttributeError):
        return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = _relative(Path(item.fspath)) or ""
        name = item.name
        reason = next((r for (f, prefix), r in SKIPPED_TESTS.items() if f == rel and name.startswith(prefix)),
                      None)
        if reason is None and "lora" in name.lower():
            reason = LORA
        if reason is None and not _starts_a_server(item):
            reason = INTERNALS
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _IGNORED:
        terminalreporter.section("files not collected (do not apply to tidal)")
        for rel, reason in sorted(_IGNORED.items()):
            terminalreporter.write_line(f"{rel}: {reason}")


@pytest.fixture(scope="session", autouse=True)
def _no_hub_downloads():
    """`snapshot_download` (LoRA files for fixtures) gives an empty folder: nothing leaves the machine."""
    import huggingface_hub

    folder = tempfile.mkdtemp(prefix="tidal-harness-hub-")
    original = huggingface_hub.snapshot_download
    huggingface_hub.snapshot_download = lambda *a, **k: folder
    yield
    huggingface_hub.snapshot_download = original


class LocalAssetServer:
    """vLLM's local media server (tests/conftest.py); the applying tests do not fetch media."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("LocalAssetServer is not part of the tidal harness")


os.environ.setdefault("HF_HUB_OFFLINE", "1")
