"""EngineCore: the step loop schedule -> run model -> sample -> commit -> emit.

``LLM.generate`` and the server both drive it: add requests (and abort them) at any time, call
:meth:`EngineCore.step` while :meth:`EngineCore.has_unfinished_requests`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from tidal.cache.allocator import PoolAllocator
from tidal.cache.prefix import PrefixCache
from tidal.detokenizer import Detokenizer
from tidal.engine.grammar import GrammarCompiler, PrefixConstraint, TokenTrie, healing_split
from tidal.cache.recount import recount
from tidal.engine.faults import FaultInjection, StepFailedError, WorkerLostError
from tidal.engine.metrics import EngineMetrics, RequestMetrics
from tidal.engine.request import (
    ImageItem,
    Logprob,
    Request,
    QueueFullError,
    RequestOutput,
    RequestTooLongError,
)
from tidal.engine.plan import StepLogits, StepPlan, plan_step
from tidal.engine.worker import Worker
from tidal.engine.sampler import SampleRow, prompt_logprobs, sample
from tidal.engine.scheduler import ScheduledBatch, Scheduler
from tidal.engine.whole_choice import WholeChoiceMatcher, pick, resolve_points
from tidal.model.kimi import KimiForCausalLM
from tidal.multimodal.encoder_cache import DEFAULT_ENCODER_CACHE_BYTES, EncoderCache
from tidal.ops import batch_invariant
from tidal.plan import SNAPSHOT_KV_FRACTION, Plan, PoolLayout, plan_for_pool, plan_table
from tidal.sampling_params import SamplingParams
from tidal.spec.config import SpeculativeConfig
from tidal.spec.decoder import SpecDecoder, make_drafter

logger = logging.getLogger("tidal.engine")

# On CPU the pool defaults to this share of the RAM the kernel reports available (MemAvailable).
CPU_POOL_FRACTION = 0.2
DEFAULT_MEM_FRACTION_STATIC = 0.9
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class EngineConfig:
    """Engine knobs (vLLM / SGLang names). ``kv_cache_memory_bytes`` sets the pool size exactly;
    otherwise it is ``mem_fraction_static`` of device memory minus the weights on a GPU, or
    ``CPU_POOL_FRACTION`` of available RAM on a CPU."""

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    page_size: int = 16
    kv_cache_memory_bytes: int | None = None
    mem_fraction_static: float = DEFAULT_MEM_FRACTION_STATIC
    # Reuse the KV pages and KDA state of earlier requests' prefixes (tidal.cache.prefix).
    enable_prefix_caching: bool = True
    # Prefill tokens between KDA state snapshots (0: only at prompt and request ends). None: the
    # plan's, derived from the model (tidal.plan.layout.prefix_snapshot_interval).
    prefix_snapshot_interval: int | None = None
    # Backpressure (None: no cap; the pool alone bounds memory, see the README). The running set
    # (SGLang's max_running_requests, vLLM's max_num_seqs) and the waiting queue: add_request
    # raises QueueFullError when max_queued_requests are queued already (EngineCore.num_queued:
    # every request not running, as SGLang counts; at least 1, since 0 would refuse everything).
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    # Vision models: bytes of tower outputs kept by image hash (taken from the default pool budget).
    encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES
    # Decode steps as captured CUDA graphs on a GPU, for batches of up to cuda_graph_max_bs
    # sequences (SGLang's --disable-cuda-graph / --cuda-graph-max-bs).
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 128
    # Speculative decoding (SGLang's --speculative-*; None: off), see tidal.spec.
    speculative: SpeculativeConfig | None = None
    # Greedy tokens independent of the batch, chunking, prefix hits and preemption in bfloat16 too
    # (SGLang's --enable-deterministic-inference): the row-invariant ops of tidal.ops.batch_invariant.
    enable_deterministic_inference: bool = False


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def default_pool_bytes(model: torch.nn.Module, device: torch.device, mem_fraction_static: float) -> int:
    """The pool budget when none is given (see :class:`EngineConfig`)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * mem_fraction_static) - model_bytes(model)
        if budget > free:
            logger.warning("mem_fraction_static %.2f leaves %d bytes, only %d free: using the free memory",
                           mem_fraction_static, budget, free)
            budget = free
        return budget
    return int(available_ram_bytes() * CPU_POOL_FRACTION)


class EngineCore:
    """Continuous batching over one hybrid memory pool; no request ever fails for lack of memory."""

    def __init__(
        self,
        model: KimiForCausalLM,
        config: EngineConfig | None = None,
        tokenizer: object | None = None,
        worker: object | None = None,
    ) -> None:
        """``worker``: where the steps run when not in this process (``tidal.parallel.workers``:
        one process per rank); ``model`` is then rank 0's model on the meta device (shapes only)."""
        self.model = model.eval()
        self.config = config = config or EngineConfig()
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.device = torch.device("cpu") if worker is not None else next(model.parameters()).device
        self.dtype = model.dtype
        self.encoder_cache: EncoderCache | None = None
        if model.has_vision:
            self.encoder_cache = EncoderCache(config.encoder_cache_bytes)
        if config.kv_cache_memory_bytes is not None:
            pool_bytes = int(config.kv_cache_memory_bytes)
        else:
            pool_bytes = default_pool_bytes(model, self.device, config.mem_fraction_static)
            if self.encoder_cache is not None:
                pool_bytes -= config.encoder_cache_bytes
        spec = config.speculative
        drafter = None
        if spec is not None:
            # The drafter's own weights and per-request context (DSPARK's cache) take memory the
            # pool would otherwise have.
            drafter = make_drafter(spec, self.model_config.vocab_size, self.dtype, self.device,
                                   target=model if worker is None else None, max_requests=config.max_running_requests)
            if config.kv_cache_memory_bytes is None:
                pool_bytes -= int(getattr(drafter, "nbytes", 0))
        # The planner's functions size the pool: what `tidal plan` prints is what the engine does.
        # With the block swap a verifying request holds 1 + k state blocks (and k tokens of KV) for the
        # step: the plan's capacities count them (tidal.plan.layout.PoolLayout.state_blocks_per_request).
        spec_tokens = spec.num_draft_tokens if spec is not None and spec.rollback == "swap" else 0
        # A tensor-parallel rank's model (tidal.parallel.shard) carries its place and the full config:
        # the plan is the planner's per-rank one, the pool this rank's share.
        place = getattr(model, "parallel", None)
        par = dict(tp_size=place.tp_size, ep_size=place.ep_size, dcp_size=place.dcp_size) if place else {}
        self.plan: Plan = plan_for_pool(
            getattr(model, "full_config", self.model_config), pool_bytes, model_bytes(model),
            page_size=config.page_size, dtype=self.dtype, spec_draft_tokens=spec_tokens, device=str(self.device), **par,
        )
        self.layout: PoolLayout = self.plan.layout
        # The books here, the bytes in the worker: each step plan carries the copies between them.
        self.pool = PoolAllocator(self.layout)
        self.prefix_cache: PrefixCache | None = None
        if config.enable_prefix_caching:
            interval = config.prefix_snapshot_interval
            self.prefix_cache = PrefixCache(self.pool, self.plan.prefix_snapshot_interval if interval is None else interval)
        for name, least in (("max_running_requests", 1), ("max_queued_requests", 1)):
            cap = getattr(config, name)
            if cap is not None and cap < least:
                raise ValueError(f"{name} must be >= {least}, got {cap}")
        self.scheduler = Scheduler(self.pool, config.max_num_batched_tokens, self.prefix_cache,
                                   max_running_requests=config.max_running_requests)
        self.media_pad_id = self._media_pad_id(tokenizer)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if config.enable_deterministic_inference:
            batch_invariant.check_available(self.device, self.dtype)
        if worker is not None:
            worker.start(self.layout)
            self.worker = worker
        else:
            self.worker = Worker(model, self.layout, self.encoder_cache,
                                 cuda_graph=not config.disable_cuda_graph, cuda_graph_max_bs=config.cuda_graph_max_bs,
                                 max_context=min(self.max_model_len, self.layout.max_context_len()),
                                 deterministic=config.enable_deterministic_inference,
                                 dcp_rank=place.dcp_rank if place else 0)
        self.num_plans = 0
        self.plan_recorder: list[StepPlan] | None = None  # set to a list to keep every plan (tests, replay)
        self.spec: SpecDecoder | None = None
        if config.speculative is not None:
            self.spec = SpecDecoder(config.speculative, self.pool, self.model_config, self.dtype, self.device,
                                    drafter=drafter)
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int) and tok_eos not in self.eos_token_ids:
            self.eos_token_ids += (tok_eos,)
        self._metrics = EngineMetrics()
        self._grammar = None  # GrammarCompiler, built on the first constrained request
        self._trie: TokenTrie | None = None  # built on the first token-healed request
        self._forks: dict[str, list[Request]] = {}  # n > 1: first sample's id -> siblings held back
        self.dead: str | None = None  # why the engine can no longer step (see tidal.engine.faults)
        self.faults = FaultInjection.from_env()
        self._steps_started = 0
        self._log_startup()

    def _media_pad_id(self, tokenizer: object | None) -> int | None:
        """The placeholder id images replace: the tokenizer's <|media_pad|>, which wins over a
        disagreeing config media_placeholder_token_id (as vLLM's K3 processor does)."""
        configured = self.model_config.media_placeholder_token_id
        special = getattr(tokenizer, "special_tokens", None) or {}
        pad = special.get("<|media_pad|>")
        if pad is not None and configured is not None and pad != configured and self.model.has_vision:
            logger.warning("config media_placeholder_token_id %d differs from the tokenizer's <|media_pad|> %d: "
                           "using %d", configured, pad, pad)
        return pad if pad is not None else configured

    # ---- capacity ------------------------------------------------------------------------------
    @property
    def max_request_len(self) -> int:
        """Prompt + output tokens one request may have: the context limit or the whole pool."""
        return min(self.max_model_len, self.layout.max_context_len())

    def _log_startup(self) -> None:
        lay = self.layout
        logger.debug(
            "memory pool: %.2f MiB in %d blocks of %.1f KiB (a block = one request's KDA state of %d B, or %d KV "
            "pages of %d tokens); device %s, dtype %s",
            lay.pool_bytes / 2**20, lay.num_blocks, lay.block_bytes / 1024, lay.state_bytes, lay.pages_per_block,
            lay.page_size, self.device, str(self.dtype).removeprefix("torch."),
        )
        logger.info(  # the one start-up line a user reads: what fits, across the DCP ranks
            "capacity: %d KV tokens per rank x dcp %d = %d logical (pool all KV); %d concurrent requests of "
            "max_model_len %d tokens, %d of 1 token; longest single request %d tokens",
            lay.kv_tokens_per_rank, lay.dcp_size, lay.kv_tokens_logical, lay.max_requests(self.max_model_len),
            self.max_model_len,
            lay.max_requests(1), self.max_request_len,
        )
        if self.prefix_cache is not None:
            how = ("set by prefix_snapshot_interval" if self.config.prefix_snapshot_interval is not None else
                   f"derived: their KV >= {SNAPSHOT_KV_FRACTION:g} x one {lay.state_bytes} B state block")
            logger.debug("prefix cache: on, a KDA state snapshot after every %d prefill tokens (%s) and at prompt "
                        "and request ends (one block each, evicted LRU)", self.prefix_cache.snapshot_interval, how)
        else:
            logger.debug("prefix cache: off")
        if self.spec is not None:
            cfg = self.spec.config
            blocks = self.spec.memory.extra_blocks(cfg.num_draft_tokens + 1)
            logger.debug("speculative decoding: %s, %d draft tokens, rollback %s: a chain holds %d extra state-sized "
                         "block(s) (%.1f KiB) and %d KV tokens for its step; the drafter holds %.1f MiB; steps "
                         "speculate %s", cfg.algorithm, cfg.num_draft_tokens, cfg.rollback, blocks,
                         blocks * lay.block_bytes / 1024, cfg.num_draft_tokens,
                         getattr(self.spec.drafter, "nbytes", 0) / 2**20,
                         "where measured faster per token" if cfg.adaptive else "always")
        logger.debug("plan:\n%s", plan_table(self.plan))

    @property
    def num_queued(self) -> int:
        """Requests added and not running: the scheduler's waiting queue (preempted ones included)
        and samples held back behind their fork leader, whether or not the running set has room
        (SGLang's count for --max-queued-requests: its len(waiting_queue) at arrival)."""
        return len(self.scheduler.waiting) + sum(len(f) for f in self._forks.values())

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        fork_of: str | None = None,
        images: list[ImageItem] | None = None,
    ) -> Request:
        """Queue a request. Raises RequestTooLongError (a ValueError) when it can never fit and
        ValueError for other invalid input; nothing is queued then.

        ``fork_of``: the id of a queued request with the same prompt (another sample of one
        ``n > 1`` request). This one waits until that one has prefilled all but the prompt's last
        token, then starts from its cached pages and KDA state (with prefix caching on).

        ``images``: where each image's placeholder tokens (``media_pad_id``) sit in the prompt,
        with its pixels."""
        cap = self.config.max_queued_requests
        if cap is not None and self.num_queued >= cap:
            self._metrics.num_requests_rejected += 1
            raise QueueFullError(
                f"the engine's waiting queue is full ({cap} requests, max_queued_requests) with "
                f"{len(self.scheduler.running)} running; retry later"
            )
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("EngineCore takes one sample per request: add n requests with "
                             "SamplingParams.for_sample(i) (LLM.generate does)")
        try:
            req = self._make_request(request_id, list(prompt_token_ids), params, prompt, arrival_time,
                                     heal=not images)
            if images or self.model.has_vision:
                self._check_images(req, list(images or []))
                req.images = sorted(images or [], key=lambda item: item.offset)
        except ValueError:
            self._metrics.num_requests_rejected += 1
            raise
        self.requests[request_id] = req
        leader = self.requests.get(fork_of) if fork_of is not None else None
        depth = req.num_prompt_tokens - 1
        if (leader is not None and self.prefix_cache is not None and depth > 0 and not leader.finished
                and leader.prompt_token_ids == req.prompt_token_ids and leader.num_computed_tokens < depth
                and [i.key for i in leader.images] == [i.key for i in req.images]
                and leader.fork_depth in (None, depth)):
            leader.fork_depth = depth
            self._forks.setdefault(leader.request_id, []).append(req)
        else:
            self.scheduler.add(req)
        return req

    def _release_forks(self) -> None:
        """Queue the siblings of leaders whose fork-depth state is cached (or that are gone)."""
        for rid in list(self._forks):
            leader = self.requests.get(rid)
            if leader is None or leader.finished or leader.num_computed_tokens >= (leader.fork_depth or 0):
                for req in self._forks.pop(rid):
                    if req.request_id in self.requests:
                        self.scheduler.add(req)

    def _make_request(
        self, rid: str, ids: list[int], params: SamplingParams, prompt: str | None, arrival: float | None,
        heal: bool = True,
    ) -> Request:
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("SamplingParams.stop (stop strings) needs a tokenizer; use stop_token_ids")
        out_of_vocab = [t for t in (params.logit_bias or {}) if t >= vocab]
        if out_of_vocab:
            raise ValueError(f"logit_bias: token id {out_of_vocab[0]} is outside the vocabulary of size {vocab} "
                             f"(ids 0..{vocab - 1})")
        P, limit = len(ids), self.max_request_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, limit - P)
        total = P + max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"request {rid!r}: prompt ({P} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        if total > self.layout.max_context_len():
            raise RequestTooLongError(
                f"request {rid!r}: prompt ({P} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds the "
                f"{self.layout.max_context_len()} tokens the whole memory pool ({self.layout.pool_bytes} bytes) "
                f"holds for one request"
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        constraint, healed = None, None
        if params.structured_outputs is not None:
            stops = () if params.ignore_eos else self.eos_token_ids
            constraint = self.grammar_compiler().compile(params.structured_outputs).matcher(
                (*stops, *params.stop_token_ids))
            points = params.structured_outputs.choice_points
            if points and hasattr(self.worker, "score"):  # a worker in this process can score options
                constraint = WholeChoiceMatcher(constraint, resolve_points(points, self.tokenizer))
        elif params.token_healing and heal and self.tokenizer is not None:
            healed = healing_split(ids, self.token_trie())
            # Re-spelling the left-out token takes up to one token per byte: heal where that fits.
            if healed is not None and total + len(self.tokenizer.token_bytes(healed)) - 1 > self.max_request_len:
                healed = None
            if healed is not None:
                ids = ids[:-1]
                constraint = PrefixConstraint(self.token_trie(), self.tokenizer, self.tokenizer.token_bytes(healed))
        detok = None
        if self.tokenizer is not None:
            detok = Detokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                drop_prefix=self.tokenizer.token_bytes(healed) if healed is not None else b"")
        return Request(
            request_id=rid,
            prompt_token_ids=ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            prompt=prompt,
            generator=generator,
            detokenizer=detok,
            metrics=RequestMetrics(arrival_time=time.monotonic() if arrival is None else arrival),
            constraint=constraint,
            healed_token_id=healed,
        )

    def token_trie(self) -> TokenTrie:
        """The vocabulary's byte trie token healing looks tokens up in (built once)."""
        if self._trie is None:
            self._trie = TokenTrie(self.tokenizer, self.model_config.vocab_size)
        return self._trie

    def grammar_compiler(self) -> GrammarCompiler:
        """The llguidance compiler over this engine's tokenizer (thread safe; built once)."""
        if self._grammar is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer")
            self._grammar = GrammarCompiler(self.tokenizer, self.eos_token_ids, self.model_config.vocab_size)
        return self._grammar

    def _check_images(self, req: Request, images: list[ImageItem]) -> None:
        if not self.model.has_vision:
            raise ValueError("this model takes no images")
        pad, ids = self.media_pad_id, req.prompt_token_ids
        end = 0
        for item in sorted(images, key=lambda i: i.offset):
            if item.offset < end or item.end > len(ids) or item.length < 1:
                raise ValueError(f"image span [{item.offset}, {item.end}) overlaps another or leaves the prompt "
                                 f"({len(ids)} tokens)")
            if any(t != pad for t in ids[item.offset : item.end]):
                raise ValueError(f"image span [{item.offset}, {item.end}) is not all placeholder tokens ({pad})")
            end = item.end
        if not images and pad in ids:  # a path that dropped its images must not run on bare placeholders
            raise ValueError(f"the prompt has image placeholder tokens ({pad}) but no images")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages and state; returns its final output (None if
        the id is unknown or already finished)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.remove(req)
        if self.spec is not None:
            self.spec.forget(request_id)
        self._release_forks()
        req.abort()
        req.metrics.finished_time = time.monotonic()
        self._metrics.num_requests_aborted += 1
        return req.to_output()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that produced a token (cumulative,
        as vLLM), finished ones with ``finished=True``. A step that raises aborts its requests and
        raises :class:`StepFailedError` (see :mod:`tidal.engine.faults`); a dead engine raises it
        at once."""
        if self.dead is not None:
            raise StepFailedError(RuntimeError(self.dead), [], self.dead)
        batch = self.scheduler.schedule()
        try:
            self._steps_started += 1
            if self.faults is not None:
                self.faults.before_step(self._steps_started, self.pool)
            if self.spec is None:
                return self._run_step(batch)
            start, tokens = time.perf_counter(), self._metrics.generation_tokens
            self.spec.extend(batch, self.config.max_num_batched_tokens - batch.num_tokens)
            outputs = self._run_step(batch)
            self.spec.record_step(batch, time.perf_counter() - start, self._metrics.generation_tokens - tokens)
            return outputs
        except Exception as e:
            raise self._fail_step(batch, e) from e

    def _fail_step(self, batch: ScheduledBatch, cause: Exception) -> StepFailedError:
        """Abort the step's requests (their state may be half-advanced: never resumed), then
        recount the pool; a pool that does not add up kills the engine."""
        logger.error("engine step failed: %s: %s; failing its %d request(s)", type(cause).__name__, cause,
                     len(batch.requests), exc_info=cause)
        rids = [r.request_id for r in batch.requests if r.request_id in self.requests]
        if self.spec is not None:
            self.spec.release_all()
        for rid in rids:
            self.abort_request(rid)
        problems = recount(self.pool, self.prefix_cache)
        if isinstance(cause, WorkerLostError):
            self.dead = f"a worker is lost: {cause}"
            logger.error("engine dead: %s", self.dead)
        elif problems:
            self.dead = f"the memory pool is inconsistent after a failed step ({'; '.join(problems)})"
            logger.error("engine dead: %s", self.dead)
        return StepFailedError(cause, rids, self.dead)

    def _run_step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        if not batch.requests:
            if self.scheduler.has_unfinished():  # a scheduler bug, never a capacity limit
                raise RuntimeError("the scheduler scheduled nothing while requests wait")
            return []
        for req in batch.new_requests:  # as sent: a healed prompt's left-out token is counted
            self._metrics.prompt_tokens += len(req.sent_prompt_token_ids)
        self.num_plans += 1
        taps = self.spec.plan_taps() if self.spec is not None else ((), 0)
        plan, rows = plan_step(self.num_plans, batch, self.pool, *taps)
        if self.plan_recorder is not None:
            self.plan_recorder.append(plan)
        logits = rows.split(self.worker.execute(plan))
        chain_taps = self._observe_taps(batch, rows) if plan.tap_layers else None
        self._metrics.num_steps += 1
        for b, (positions, lg) in logits.prompt.items():
            self._record_prompt_logprobs(batch.requests[b], positions, lg)
        for b, (req, n) in enumerate(zip(batch.requests, batch.query_lens)):
            if b not in batch.drafts:  # a chain's computed tokens are what it commits
                req.num_computed_tokens += n
        snap = [r for b, (r, c, n) in enumerate(zip(batch.requests, batch.cached_lens, batch.query_lens))
                if b not in batch.drafts and self.scheduler.snapshot_due(r, c, n)]
        outputs = self._sample(batch, logits) if logits.sample_logits is not None else []
        if logits.chains:
            outputs += self._commit_chains(batch, logits, chain_taps)
        for req in snap:
            if not req.finished:  # a finished one handed its state to the cache already
                self.scheduler.snapshot(req)
        if self._forks:
            self._release_forks()
        return outputs

    def _sample(self, batch: ScheduledBatch, logits: StepLogits) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        reqs = [batch.requests[b] for b in logits.sample_seqs]
        for j, req in enumerate(reqs):
            if isinstance(req.constraint, WholeChoiceMatcher) and req.constraint.pending is not None:
                self._choose_whole(req, req.constraint, logits.sample_logits[j])
        rows = [SampleRow(r.params, r.generator, r.banned_tokens(), r.token_ids, r.num_prompt_tokens, r.constraint)
                for r in reqs]
        for j, req in enumerate(reqs):
            if req.healed_token_id is not None and req.num_output_tokens == 0:
                self._record_healed_logprob(req, logits.sample_logits[j:j + 1])
        now = time.monotonic()
        for req, res in zip(reqs, sample(logits.sample_logits, rows)):
            self._append(req, res, now)
            self._finish_if_done(req, now)
            outputs.append(req.to_output())
        return outputs

    def _choose_whole(self, req: Request, matcher: WholeChoiceMatcher, last_logits: torch.Tensor) -> None:
        """At a choice point: score each open option whole after the request's tokens and force
        the pick (tidal.engine.whole_choice), from the state this step left in the request's
        state block and pages and its ``last_logits`` (no second prefill). A request with images
        is left to the token mask."""
        if req.images:
            matcher.decline()
            return
        assert matcher.pending is not None
        # Invariant: a sampled request has every token computed, so the pool holds its whole state.
        assert req.num_computed_tokens == req.num_tokens
        rid = req.request_id
        scores = self.worker.score(self.pool.state_block(rid), self.pool.page_table(rid), req.num_tokens,
                                   last_logits, [ids for _, ids in matcher.pending])
        matcher.choose(pick(scores, req.params, req.generator))

    def _append(self, req: Request, res, now: float) -> None:
        """Record one sampled token of ``req`` (logprobs, constraint, stop checks, metrics)."""
        piece = None
        if isinstance(req.constraint, PrefixConstraint):  # token healing: what shows past the prompt
            past = req.constraint.past(res.token_id)
            if past is None:  # counted as the prompt's token it re-spells
                req.num_healing_tokens += 1
                self._metrics.generation_tokens -= 1
            else:
                piece = past.decode("utf-8", errors="replace")
        if req.logprobs is not None:
            entry = {res.token_id: Logprob(res.logprob, res.rank, self._piece(res.token_id) if piece is None
                                           else piece)}
            for i, (tok, lp) in enumerate(res.top):
                entry.setdefault(tok, Logprob(lp, i + 1, self._piece(tok)))
            req.logprobs.append(entry)
            req.cumulative_logprob += res.logprob
        if req.constraint is not None:
            req.constraint.accept(res.token_id)
            if isinstance(req.constraint, PrefixConstraint) and req.constraint.finished:
                req.constraint = None
        req.append_token(res.token_id)
        req.metrics.on_token(now)
        self._metrics.generation_tokens += 1

    def _finish_if_done(self, req: Request, now: float) -> None:
        if req.finished:
            req.metrics.finished_time = now
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
            if self.spec is not None:
                self.spec.forget(req.request_id)
            self._metrics.num_requests_finished += 1

    def _observe_taps(self, batch: ScheduledBatch, rows) -> dict[str, torch.Tensor]:
        """Hand the drafter the tapped hidden states of this step's computed tokens; a chain's
        (request id -> all its positions' rows) are returned for its commit, which keeps only the
        committed positions'."""
        assert self.spec is not None
        taps = self.worker.last_taps
        chains: dict[str, torch.Tensor] = {}
        seen = []
        ids, positions, at = [], [], []  # plain decodes: one position each, handed over in one tensor
        for b, first, count, start in rows.taps:
            rid = batch.requests[b].request_id
            if b in batch.drafts:
                chains[rid] = taps[start : start + count]
            elif count == 1:
                ids.append(rid)
                positions.append(first)
                at.append(start)
            else:
                seen.append((rid, first, taps[start : start + count]))
        if seen:
            self.spec.observe(seen)
        if ids:
            one_run = at[-1] - at[0] == len(at) - 1  # consecutive rows (a decode-only step): a view
            self.spec.observe_decodes(ids, positions, taps[at[0] : at[-1] + 1] if one_run else taps[at])
        return chains

    def _commit_chains(self, batch: ScheduledBatch, logits: StepLogits,
                       taps: dict[str, torch.Tensor] | None = None) -> list[RequestOutput]:
        """Append each verified chain's committed tokens, roll its state and pages back to them
        (before a finished request hands them to the prefix cache), then emit."""
        assert self.spec is not None
        now = time.monotonic()
        chains = []
        for b, chain_logits in logits.chains.items():
            req, draft = batch.requests[b], batch.drafts[b]
            accepted = appended = 0
            for j, res in enumerate(self.spec.accept(req, draft, chain_logits)):
                self._append(req, res, now)
                appended += 1
                accepted += int(j < len(draft.tokens) and res.token_id == draft.tokens[j])
                if req.finished:
                    break
            chains.append((req, batch.cached_lens[b], len(draft.tokens), accepted, appended))
        self.spec.commit(chains, taps)
        outputs = []
        for req, *_ in chains:
            self._finish_if_done(req, now)
            outputs.append(req.to_output())
        return outputs

    def _record_prompt_logprobs(self, req: Request, positions: list[int], logits: torch.Tensor) -> None:
        assert req.prompt_logprobs is not None and req.params.prompt_logprobs is not None
        sent = req.sent_prompt_token_ids
        targets = [sent[t + 1] for t in positions]
        for target, (lp, rank, top) in zip(targets, prompt_logprobs(logits, targets, req.params.prompt_logprobs)):
            entry = {target: Logprob(lp, rank, self._piece(target))}
            for i, (tok, v) in enumerate(top):
                entry.setdefault(tok, Logprob(v, i + 1, self._piece(tok)))
            req.prompt_logprobs.append(entry)

    def _record_healed_logprob(self, req: Request, logits: torch.Tensor) -> None:
        """The prompt logprob of the token healing left out: the first output position scores it
        (the raw distribution, before the healing mask)."""
        if req.prompt_logprobs is None or len(req.prompt_logprobs) != req.num_prompt_tokens:
            return  # not asked for, or recorded before a preemption
        self._record_prompt_logprobs(req, [req.num_prompt_tokens - 1], logits)

    def _piece(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    # ---- prefix cache --------------------------------------------------------------------------
    def flush_prefix_cache(self) -> bool:
        """Drop every cached prefix: all pages and snapshots not also held by a running request
        return to the pool at once (running requests are unaffected). Call it between steps, from
        the thread that steps. False when prefix caching is disabled (nothing to flush)."""
        if self.prefix_cache is None:
            return False
        self.prefix_cache.flush()
        return True

    # ---- metrics -------------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        m = self._metrics
        u = self.pool.usage()
        m.num_running = len(self.scheduler.running)
        m.num_waiting = len(self.scheduler.waiting)
        m.pool_usage = u.usage
        m.pool_free_pages = u.free_pages
        m.pool_total_pages = u.total_pages
        m.pool_state_blocks = u.state_blocks
        m.pool_kv_blocks = u.kv_blocks
        m.num_preemptions = self.scheduler.num_preemptions
        m.recomputed_tokens = self.scheduler.recomputed_tokens
        m.num_compactions = self.pool.num_compactions
        m.prefix_cache_queries = self.scheduler.prefix_queries
        m.prefix_cache_hits = self.scheduler.prefix_hits
        if self.prefix_cache is not None:
            m.prefix_cache_snapshots = self.prefix_cache.num_snapshots
            m.prefix_cache_pages = self.pool.cache_only_pages
            m.prefix_cache_evicted_snapshots = self.prefix_cache.num_evicted_snapshots
        if self.spec is not None:
            sm = self.spec.metrics
            m.spec_num_chains, m.spec_num_draft_tokens = sm.num_chains, sm.num_drafted_tokens
            m.spec_num_accepted_tokens = sm.num_accepted_tokens
            m.spec_accept_length_counts = list(sm.accept_length_counts)
            m.spec_position_drafted, m.spec_position_accepted = list(sm.position_drafted), list(sm.position_accepted)
        return m

