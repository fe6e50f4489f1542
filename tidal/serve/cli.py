"""``tidal serve``: the OpenAI- and Anthropic-compatible server (the embedded model by default).

The engine runs in its own process (the engine core: scheduler, memory pool, model); this process
serves HTTP. It listens once the core is ready. SIGTERM / SIGINT: in-flight requests end at once
(streams with an error event), the core stops, the process exits. A second SIGINT forces the exit.
A core that dies turns /health to 503 and fails open requests; it never outlives this process.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.multimodal.decode import DEFAULT_LIMIT_IMAGES_PER_PROMPT, DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS
from tidal.engine.core import DEFAULT_MAX_NUM_BATCHED_TOKENS
from tidal.model.checkpoint import LOAD_STRATEGIES
from tidal.serve.app import DEFAULT_MAX_REQUEST_BYTES
from tidal.units import parse_bytes, parse_count
from tidal.serve.chat.effort import DEFAULT_EFFORT, REQUEST_EFFORTS, request_effort

logger = logging.getLogger("tidal.serve")
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's lines and shows every default (once: a help text that
    already says its default keeps its own wording)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal serve", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                   help="checkpoint directory (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (checked before the model loads)")
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY or x-api-key)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: MODEL_DIR, or tidal-embedded)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and cache dtype (auto: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--quantization", "-q", default=None, choices=["mxfp4"],
                   help="routed experts kept packed in this format (default: the checkpoint's "
                        "quantization_config; mxfp4 packs a dense checkpoint's experts at load)")
    p.add_argument("--safetensors-load-strategy", default="lazy", choices=LOAD_STRATEGIES,
                   help="lazy: weights are private views of the memory-mapped checkpoint files (no copy); "
                        "eager: every weight read into memory of its own (llama.cpp's --no-mmap)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda when available)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks, one worker process each")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel groups among the TP ranks (tp %% ep == 0)")
    p.add_argument("--dcp-size", type=int, default=1,
                   help="decode-context-parallel ranks among the TP ranks sharing the MLA KV (tp %% dcp == 0)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes the TP ranks are spread over")
    p.add_argument("--node-rank", type=int, default=0, help="this node (0 runs the server; others only workers)")
    p.add_argument("--dist-init-addr", default=None, help="host:port every rank joins (needed with --nnodes > 1)")
    p.add_argument("--dist-timeout", type=float, default=None,
                   help="seconds a torch.distributed collective may wait before the ranks count as lost (default 60)")
    p.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None,
                   help="memory pool size: bytes, or with a unit (1GiB, 512MB; default: planned from free memory)")
    p.add_argument("--max-model-len", type=parse_count, default=None,
                   help="context limit in tokens, 8k = 8000, 8K = 8192 (default: the model's)")
    p.add_argument("--max-num-batched-tokens", type=parse_count, default=None,
                   help=f"tokens per engine step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="on a GPU, the pool is this share of device memory minus the weights (default 0.9)")
    p.add_argument("--disable-cuda-graph", action="store_true", help="run decode steps eagerly on a GPU")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="greedy output independent of the batch, chunking, prefix hits and preemption, in bfloat16 "
                        "too (row-invariant kernels; CPU only; slower prefill)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch run as a captured CUDA graph (default 128)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages and KDA state of earlier requests' prefixes")
    p.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false",
                   help="same as --no-enable-prefix-caching")
    p.add_argument("--prefix-snapshot-interval", type=int, default=None,
                   help="snapshot the KDA state after every N prompt tokens for prefix hits (default: derived "
                        "from the model, the tokens whose KV is worth one state block; printed at start-up)")
    p.add_argument("--max-running-requests", "--max-num-seqs", dest="max_running_requests", type=int,
                   default=None, help="cap on requests running at once (default: none, the memory pool decides)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="cap on requests not running (new, preempted: SGLang's count); beyond it a request gets 503 "
                        "with Retry-After (default: none)")
    p.add_argument("--max-request-bytes", type=parse_bytes, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413")
    p.add_argument("--reasoning-alias", action=argparse.BooleanOptionalAction, default=True,
                   help="also send reasoning as `reasoning` (vLLM's newer name) next to `reasoning_content`")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name every token 'token_id:N' (per request: return_tokens_as_token_ids)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream carries usage on every chunk, as if it asked for include_usage and "
                        "continuous_usage_stats")
    p.add_argument("--token-healing", action=argparse.BooleanOptionalAction, default=True,
                   help="token healing of /v1/completions text prompts (a request's token_healing field wins)")
    p.add_argument("--tool-name-choice", default="mask", choices=["mask", "whole"],
                   help="K3 chat: pick the called tool's name by the reply grammar's token mask, or score each "
                        "declared name whole and write the best (README, 'Which tool')")
    p.add_argument("--no-ui", dest="ui", action="store_false", help="do not serve the chat page at / and /chat")
    p.add_argument("--default-reasoning-effort", default=None, choices=sorted(REQUEST_EFFORTS),
                   help="thinking effort of chat requests that name none (default: the model's own, from "
                        "default_reasoning_effort in its config.json, else K3's max); see the effort table in the README")
    p.add_argument("--limit-mm-per-prompt", type=_mm_limit, default=DEFAULT_LIMIT_IMAGES_PER_PROMPT,
                   metavar='\'{"image": N}\'', help="most images in one prompt (vLLM's JSON form, or image=N)")
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="larger images (width x height, read from the header) are refused with a 400")
    p.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
                   help="larger encoded images (inline or fetched) are refused with a 400")
    p.add_argument("--allow-image-url-fetch", action="store_true",
                   help="fetch http(s) image URLs (off: only data: URLs and base64 images are taken)")
    p.add_argument("--image-fetch-timeout", type=float, default=5.0, help="seconds an image URL fetch may take")
    p.add_argument("--speculative-algorithm", default=None, type=str.upper, choices=["NGRAM", "STANDALONE", "DSPARK"],
                   help="speculative decoding (NGRAM: prompt lookup; STANDALONE: a small draft model of the "
                        "same tokenizer; DSPARK: a block drafter on the target's hidden states)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="tokens drafted per request and step (the verified chain is one longer; default 4, DSPARK 7)")
    p.add_argument("--speculative-draft-model-path", default=None, help="the draft model (STANDALONE, DSPARK)")
    p.add_argument("--speculative-dspark-block-size", type=int, default=None, help="DSPARK's block size")
    p.add_argument("--enable-linear-replayssm-spec", action="store_true",
                   help="roll the KDA state back by an fp32 checkpoint + replay of the accepted tokens instead of "
                        "a state block per drafted position")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="debug adds the memory planner's tables (also: tidal plan)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="one line per HTTP request")
    p.add_argument("--stats-interval", type=float, default=10.0,
                   help="seconds between stats lines (throughput, queue, pool, prefix hits) while busy; 0: none")
    return p


def _mm_limit(text: str) -> int:
    """``--limit-mm-per-prompt``: '{"image": 4}' (vLLM) or 'image=4'; only images are taken."""
    try:
        value = json.loads(text) if text.strip().startswith("{") else dict(
            (k.strip(), int(v)) for k, v in (item.split("=", 1) for item in text.split(",")))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"expected '{{\"image\": N}}' or image=N, got {text!r} ({e})") from None
    unknown = set(value) - {"image"}
    if unknown or not isinstance(value.get("image"), int) or value["image"] < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative image count only, got {text!r}")
    return value["image"]


def generation_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling fields of the checkpoint's generation_config.json."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    cfg = json.loads(path.read_text())
    return {k: cfg[k] for k in SAMPLING_DEFAULT_KEYS if cfg.get(k) is not None}


def model_default_effort(model_dir: Path) -> str:
    """The thinking level the checkpoint declares (``default_reasoning_effort`` in config.json),
    else K3's default."""
    try:
        value = json.loads((model_dir / "config.json").read_text()).get("default_reasoning_effort")
    except (OSError, ValueError):
        value = None
    return request_effort(value) if value is not None else DEFAULT_EFFORT


def log_summary(st: Any, url: str, tp_size: int = 1) -> None:
    """The start-up in a few lines: what is served, on what, with how much room, where."""
    e = st.engine
    lay = e.layout
    logger.info("serving %s (%s): %s on %s, chat format %s, default thinking effort %s",
                st.model_name, st.config.model_path, e.dtype, e.device,
                st.chat.name if st.chat else "none", st.config.default_reasoning_effort)
    if lay.dcp_size > 1:  # each DCP rank stores 1/dcp of every request's tokens
        kv = (f"{lay.kv_tokens_per_rank} KV tokens per rank x dcp {lay.dcp_size} = {lay.kv_tokens_logical} "
              f"tokens of context across the DCP group")
    else:
        kv = f"{lay.kv_tokens_logical} KV tokens"
    logger.info("memory pool %.2f GiB%s: %s, %d requests of %d tokens at once (%d of 1 token); "
                "longest request %d tokens", lay.pool_bytes / 2**30, " per rank" if tp_size > 1 else "", kv,
                lay.max_requests(e.max_model_len), e.max_model_len, lay.max_requests(1), e.max_request_len)
    logger.info("listening on %s (OpenAI /v1, Anthropic /v1/messages, /metrics)", url)


def _make_server(config: Any, on_exit: Callable[[], None]) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, telling the app when a shutdown signal arrives: uvicorn would
        otherwise wait for every open stream to finish before shutting down."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            on_exit()
            super().handle_exit(sig, frame)

    return Server(config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    import torch

    from tidal.serve.engine_client import EngineClient, EngineStartError

    torch.set_num_threads(1)  # the cores are the engine core's; this process only frames HTTP
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    from tidal.embedded import embedded_model_dir

    model_dir = Path(args.model_dir) if args.model_dir else embedded_model_dir()
    from tidal.parallel.flags import check_flags

    try:
        check_flags(args.tp_size, args.ep_size, args.dcp_size, args.nnodes, args.node_rank, args.dist_init_addr)
    except ValueError as e:
        print(f"tidal serve: {e}", file=sys.stderr)
        return 2
    if args.node_rank > 0:  # a worker node: no server, its ranks until the core stops them
        from tidal.parallel.workers import DEFAULT_TIMEOUT_S, run_node

        return run_node(str(model_dir), dtype, tp_size=args.tp_size, ep_size=args.ep_size, dcp_size=args.dcp_size,
                        nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
                        timeout_s=args.dist_timeout or DEFAULT_TIMEOUT_S, device=device,
                        quantization=args.quantization, safetensors_load_strategy=args.safetensors_load_strategy)
    try:  # the port first: a port in use is an error before minutes of loading, not after
        sock = socket.create_server((args.host, args.port), reuse_port=False)
    except OSError as e:
        print(f"tidal serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    llm_kwargs = dict(model=str(model_dir), dtype=dtype, device=device, quantization=args.quantization,
                      safetensors_load_strategy=args.safetensors_load_strategy,
                      kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=args.max_model_len,
                      max_num_batched_tokens=args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
                      enable_prefix_caching=args.enable_prefix_caching,
                      prefix_snapshot_interval=args.prefix_snapshot_interval,
                      max_running_requests=args.max_running_requests, max_queued_requests=args.max_queued_requests,
                      mem_fraction_static=args.mem_fraction_static, disable_cuda_graph=args.disable_cuda_graph,
                      cuda_graph_max_bs=args.cuda_graph_max_bs, speculative_algorithm=args.speculative_algorithm,
                      speculative_num_draft_tokens=args.speculative_num_draft_tokens,
                      speculative_draft_model_path=args.speculative_draft_model_path,
                      speculative_dspark_block_size=args.speculative_dspark_block_size,
                      enable_linear_replayssm_spec=args.enable_linear_replayssm_spec,
                      enable_deterministic_inference=args.enable_deterministic_inference)
    if args.tp_size > 1:
        llm_kwargs.update(tp_size=args.tp_size, ep_size=args.ep_size, dcp_size=args.dcp_size, nnodes=args.nnodes,
                          dist_init_addr=args.dist_init_addr, dist_timeout=args.dist_timeout)
    client = EngineClient(llm_kwargs, log_level=args.log_level)
    client.spawn_core()  # it loads the model while this process imports the app
    from tidal.config import ConfigError

    try:
        import uvicorn

        from tidal.model.checkpoint import read_config
        from tidal.multimodal import ImageLimits
        from tidal.serve.app import ServerConfig, create_app
        from tidal.tokenizer import load_tokenizer

        model_config = read_config(model_dir)
        tokenizer = load_tokenizer(model_dir)
        client.wait_ready()
    except (ValueError, OSError, ConfigError, EngineStartError) as e:
        client.kill_core()
        client.close()
        print(f"tidal serve: {e}", file=sys.stderr)
        return 2
    names = args.served_model_name or [args.model_dir or "tidal-embedded"]
    config = ServerConfig(
        served_model_names=names, model_path=str(model_dir), api_key=args.api_key,
        max_request_bytes=args.max_request_bytes, generation_defaults=generation_defaults(model_dir),
        reasoning_alias=args.reasoning_alias, ui=args.ui, tokens_as_ids=args.return_tokens_as_token_ids,
        force_include_usage=args.enable_force_include_usage,
        token_healing=args.token_healing, tool_name_choice=args.tool_name_choice,
        default_reasoning_effort=(request_effort(args.default_reasoning_effort) if args.default_reasoning_effort
                                  else model_default_effort(model_dir)),
        image_limits=ImageLimits(max_images=args.limit_mm_per_prompt, max_pixels=args.max_image_pixels,
                                 max_bytes=args.max_image_bytes, allow_url_fetch=args.allow_image_url_fetch,
                                 fetch_timeout=args.image_fetch_timeout),
        stats_interval=args.stats_interval,
        info={"args": {k: v for k, v in vars(args).items() if k != "api_key"}},
    )
    app = create_app(client, config, tokenizer, model_config)
    log_summary(app.state.tidal, f"http://{args.host}:{args.port}", args.tp_size)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                               access_log=args.access_log, timeout_graceful_shutdown=5)
    server = _make_server(uv_config, lambda: client.fail_all_threadsafe("the server is shutting down"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after the clean shutdown
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
