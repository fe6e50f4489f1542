"""Offline API, as vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Sequence, Union

import torch

from tidal.config import parse_dtype
from tidal.engine.core import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig, EngineCore
from tidal.engine.request import RequestOutput
from tidal.model.checkpoint import resolve_quantization, use_mmap_for
from tidal.model.kimi import KimiForCausalLM
from tidal.model.moe import pack_experts
from tidal.sampling_params import SamplingParams
from tidal.spec.config import SpeculativeConfig

PromptType = Union[str, dict[str, Any]]


def _default_model_dir() -> Path:
    from tidal.embedded import embedded_model_dir

    path = embedded_model_dir()
    if not (path / "config.json").exists():
        raise ValueError(f"the embedded model is not installed at {path}; pass a checkpoint directory as model=")
    return path


class LLM:
    """An engine over one model.

    ``model``: a checkpoint directory, None for the embedded default model, or an in-memory
    :class:`KimiForCausalLM` (converted to ``dtype`` when one is given). ``tokenizer``: any object
    with ``encode``/``decode``; by default the checkpoint's ``tokenizer.json`` unless
    ``skip_tokenizer_init``. ``kv_cache_memory_bytes`` sets the memory pool size exactly.
    ``enable_prefix_caching`` / ``prefix_snapshot_interval``: see :class:`EngineConfig`.
    ``safetensors_load_strategy`` (vLLM's): "lazy" (default) maps the checkpoint's files, so a weight
    whose bytes on disk are its bytes in memory is a private view of the file's pages; "eager" reads
    every weight into memory of its own (llama.cpp's ``--no-mmap``); on every rank alike.
    ``quantization`` (vLLM's): "mxfp4" keeps the routed experts packed in MXFP4, quantising dense
    ones; None follows the checkpoint (MXFP4 experts stay packed). An in-memory model is used as it
    is unless "mxfp4" is asked. ``speculative_*`` / ``enable_linear_replayssm_spec``: speculative
    decoding as SGLang names it (:class:`tidal.spec.SpeculativeConfig`). ``tp_size`` / ``ep_size`` /
    ``dcp_size`` (SGLang's names) > 1: one worker process per rank loads its shard of the checkpoint directory (``tidal.parallel.workers``);
    ``nnodes`` > 1 with ``dist_init_addr`` "host:port": the other nodes run ``tidal serve
    --node-rank k`` with the same flags; ``dist_timeout`` (SGLang's): seconds a collective may wait
    (a hung rank is found sooner, by its heartbeat: ``tidal.parallel.watchdog``); ranks on ``device``
    "cuda" take their node's GPUs in order. Call :meth:`close` to stop the workers.
    """

    def __init__(
        self,
        model: str | Path | KimiForCausalLM | None = None,
        dtype: str | torch.dtype | None = "float32",
        skip_tokenizer_init: bool = False,
        kv_cache_memory_bytes: int | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_model_len: int | None = None,
        page_size: int = 16,
        device: str | torch.device | None = None,
        mem_fraction_static: float | None = None,
        tokenizer: Any | None = None,
        enable_prefix_caching: bool = True,
        prefix_snapshot_interval: int | None = None,
        quantization: str | None = None,
        max_running_requests: int | None = None,
        max_queued_requests: int | None = None,
        disable_cuda_graph: bool = False,
        cuda_graph_max_bs: int | None = None,
        speculative_algorithm: str | None = None,
        speculative_num_draft_tokens: int | None = None,
        speculative_draft_model_path: str | None = None,
        speculative_dspark_block_size: int | None = None,
        enable_linear_replayssm_spec: bool = False,
        enable_deterministic_inference: bool = False,
        tp_size: int = 1,
        ep_size: int = 1,
        dcp_size: int = 1,
        nnodes: int = 1,
        dist_init_addr: str | None = None,
        dist_timeout: float | None = None,
        safetensors_load_strategy: str = "lazy",
    ) -> None:
        use_mmap = use_mmap_for(safetensors_load_strategy)  # a bad name fails before anything loads
        speculative = SpeculativeConfig.from_args(  # bad settings fail before the model loads
            speculative_algorithm, speculative_num_draft_tokens, speculative_draft_model_path,
            speculative_dspark_block_size, enable_linear_replayssm_spec)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.workers = None  # tidal.parallel.workers.RankWorkers when tp_size > 1
        if tp_size > 1:
            if model is None or isinstance(model, torch.nn.Module):
                raise ValueError("tp_size > 1 loads each rank's shard from a checkpoint directory: pass model=<dir>")
            if enable_deterministic_inference:
                raise ValueError("enable_deterministic_inference runs in one process: it needs tp_size=1")
            if device.type == "cuda" and kv_cache_memory_bytes is None:
                raise ValueError("tp_size > 1 on CUDA needs kv_cache_memory_bytes (the pool per rank): the engine "
                                 "core does not measure the ranks' GPUs")
            net, self.workers = _rank_workers(Path(model), dtype or "float32", quantization, tp_size, ep_size, dcp_size,
                                              nnodes, dist_init_addr, dist_timeout, str(device),
                                              safetensors_load_strategy)
            model_dir = Path(model)
        elif isinstance(model, torch.nn.Module):
            net = model
            if dtype is not None and net.dtype != parse_dtype(dtype):
                net = net.to_dtype(parse_dtype(dtype))
            if resolve_quantization(net.config, quantization) == "mxfp4" and quantization is not None:
                pack_experts(net)
            model_dir = None
        else:
            from tidal.model.checkpoint import load_model, read_config

            model_dir = Path(model) if model is not None else _default_model_dir()
            quantization = resolve_quantization(read_config(model_dir), quantization)
            net = load_model(model_dir, parse_dtype(dtype or "float32"), device, quantization=quantization,
                             use_mmap=use_mmap)
        if tokenizer is None and model_dir is not None and not skip_tokenizer_init:
            from tidal.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model_dir)
        self.tokenizer = None if skip_tokenizer_init else tokenizer
        config = EngineConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            page_size=page_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
            max_running_requests=max_running_requests,
            max_queued_requests=max_queued_requests,
            enable_deterministic_inference=enable_deterministic_inference,
        )
        if prefix_snapshot_interval is not None:
            config.prefix_snapshot_interval = prefix_snapshot_interval
        if mem_fraction_static is not None:
            config.mem_fraction_static = mem_fraction_static
        config.disable_cuda_graph = disable_cuda_graph
        config.speculative = speculative
        if cuda_graph_max_bs is not None:
            config.cuda_graph_max_bs = cuda_graph_max_bs
        self.engine = EngineCore(net, config, self.tokenizer, worker=self.workers)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the rank workers (tp_size > 1; nothing to do otherwise)."""
        if self.workers is not None:
            self.workers.close()

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]} instead")
        enc = self.tokenizer.encode(prompt)
        return prompt, list(getattr(enc, "ids", enc))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. Every request is validated
        before any runs, so an impossible one raises (RequestTooLongError) with nothing started."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        tokenized = [self._tokenize(p) for p in prompts]
        ids = [str(next(self._ids)) for _ in prompts]
        samples: dict[str, list[str]] = {}  # request id -> the engine ids of its n samples
        added: list[str] = []
        try:
            for rid, (text, token_ids), sp in zip(ids, tokenized, params):
                samples[rid] = [rid] if sp.n == 1 else [f"{i}_{rid}" for i in range(sp.n)]
                for i, sid in enumerate(samples[rid]):
                    self.engine.add_request(sid, token_ids, sp.for_sample(i) if sp.n > 1 else sp, prompt=text,
                                            fork_of=samples[rid][0] if i else None)
                    added.append(sid)
        except ValueError:
            for sid in added:
                self.engine.abort_request(sid)
            raise
        results: dict[str, RequestOutput] = {}
        while len(results) < len(added):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"the engine stopped with {len(added) - len(results)} requests unfinished")
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [_merge(rid, [results[s] for s in samples[rid]]) for rid in ids]


def _rank_workers(model_dir: Path, dtype: str | torch.dtype, quantization: str | None, tp: int, ep: int,
                  dcp: int, nnodes: int, dist_init_addr: str | None, dist_timeout: float | None,
                  device: str, load_strategy: str = "lazy") -> tuple[KimiForCausalLM, Any]:
    """Rank 0's model on the meta device (the engine core reads its shapes) and the rank workers."""
    from tidal.model.checkpoint import read_config
    from tidal.parallel.groups import Collectives, RankPlace
    from tidal.parallel.shard import build_rank_model
    from tidal.parallel.workers import DEFAULT_TIMEOUT_S, RankWorkers

    config = read_config(model_dir)
    place = RankPlace(0, tp, ep, dcp)
    packed = resolve_quantization(config, quantization) == "mxfp4"
    with torch.device("meta"):
        skeleton = build_rank_model(config, place, Collectives(place, None, None), packed=packed)
    skeleton.to_dtype(parse_dtype(dtype))
    name = str(parse_dtype(dtype)).removeprefix("torch.")
    return skeleton, RankWorkers(str(model_dir), name, tp_size=tp, ep_size=ep, dcp_size=dcp, nnodes=nnodes,
                                 dist_init_addr=dist_init_addr, timeout_s=dist_timeout or DEFAULT_TIMEOUT_S,
                                 device=device, quantization=quantization, safetensors_load_strategy=load_strategy)


def _merge(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """One output per prompt: the samples of an n > 1 request as its ``outputs`` 0..n-1."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    completions = []
    for i, o in enumerate(outs):
        c = o.outputs[0]
        c.index = i
        completions.append(c)
    return RequestOutput(request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                         prompt_logprobs=first.prompt_logprobs, outputs=completions, finished=True,
                         metrics=first.metrics, num_cached_tokens=first.num_cached_tokens)
