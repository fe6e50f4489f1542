"""The FastAPI app: OpenAI routes (chat, completions, models), Anthropic Messages, tokenizer and
admin routes, over one :class:`EngineClient`.

Every handler validates and tokenises, submits to the engine core (its own process), then either streams SSE or
collects the whole reply while watching for the client to go away; either way a request whose
client leaves is aborted in the engine at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

import tidal
from tidal.config import ModelConfig
from tidal.engine.grammar import GrammarCompiler
from tidal.engine.request import QueueFullError, RequestTooLongError
from tidal.multimodal import ImageLimits
from tidal.serve import anthropic_api as anth
from tidal.serve import openai_api as oai
from tidal.serve import openai_protocol as proto
from tidal.sampling_params import SamplingParams, StructuredOutputsParams
from tidal.serve import responses_api, vllm_routes
from tidal.serve.chat import (
    DEFAULT_EFFORT,
    ChatFormat,
    RenderedPrompt,
    chat_format_for,
    thinking_effort,
)
from tidal.serve.engine_client import (
    EngineClient,
    EngineError,
    EngineRequest,
    RequestStream,
    TokenDelta,
    sample_requests,
)
from tidal.serve.errors import (
    APIError,
    bad_request,
    context_length_error,
    error_bytes,
    install_error_handlers,
)
from tidal.serve.images import encode_with_images
from tidal.serve.metrics import ServerMetrics
from tidal.serve.stats_log import log_stats
from tidal.serve.wire import EngineInfo
from tidal.serve.ui import UI_PATHS, add_ui_routes

logger = logging.getLogger("tidal.serve")

DEFAULT_MAX_REQUEST_BYTES = 32 << 20
# Routes anyone may call when --api-key is set (probes and scrapers).
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})
# Retry-After of a 503 for a full waiting queue: about one engine step's worth of waiting.
QUEUE_FULL_RETRY_AFTER_S = 1
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerConfig:
    """What the app needs besides the engine. ``generation_defaults`` (the checkpoint's
    generation_config) fill sampling fields a request leaves out; ``info`` is echoed by
    ``/server_info``."""

    served_model_names: list[str]
    model_path: str
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    reasoning_alias: bool = True
    ui: bool = True  # the chat page at / and /chat (--no-ui turns it off)
    tokens_as_ids: bool = False  # --return-tokens-as-token-ids: every request's logprobs name "token_id:N"
    force_include_usage: bool = False  # --enable-force-include-usage: every stream has usage on every chunk
    token_healing: bool = True  # /v1/completions text prompts, unless the request says (--no-token-healing)
    default_reasoning_effort: str = DEFAULT_EFFORT  # chat completions' effort when a request names none
    # How a K3 chat reply's tool name is picked: "mask" (the grammar's token mask, token by token) or
    # "whole" (each declared name scored whole, tidal.engine.whole_choice); --tool-name-choice.
    tool_name_choice: str = "mask"
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    stats_interval: float = 0.0  # seconds between periodic stats lines (0: none)
    info: dict[str, Any] = field(default_factory=dict)


class ServerState:
    """The engine client, tokenizer, chat format and metrics one app serves with."""

    def __init__(self, client: EngineClient, config: ServerConfig, tokenizer: Any, model_config: ModelConfig) -> None:
        if client.info is None:
            raise ValueError("start the engine core (EngineClient.start_core) before building the app")
        self.client = client
        self.engine: EngineInfo = client.info
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.chat: ChatFormat | None = (
            chat_format_for(self.tokenizer, model_config) if self.tokenizer is not None else None
        )
        self.metrics = ServerMetrics(config.served_model_names[0], lambda: self.client.stats())
        client.on_finished = self.metrics.observe
        self._grammar: GrammarCompiler | None = None

    def grammar_compiler(self) -> GrammarCompiler:
        """A compiler like the core's, to refuse a bad grammar with a 400 before it is queued."""
        if self._grammar is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer")
            self._grammar = GrammarCompiler(self.tokenizer, self.engine.eos_token_ids, self.model_config.vocab_size)
        return self._grammar

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + output) the server accepts."""
        return self.engine.max_request_len

    def check_model(self, name: str | None) -> None:
        if name not in self.config.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", code="model_not_found", param="model")

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids")
        return self.tokenizer

    def need_chat(self) -> ChatFormat:
        if self.chat is None:
            raise bad_request("this model has no tokenizer, so no chat format: use /v1/completions with token ids")
        return self.chat

    def chat_effort(self, reasoning_effort: str | None, chat_template_kwargs: Any = None,
                    thinking: Any = None) -> str:
        """The K3 level of an OpenAI-style request (the server's default when it names none);
        an unknown value is a 400 naming the field it came from."""
        try:
            return thinking_effort(reasoning_effort, chat_template_kwargs, self.config.default_reasoning_effort,
                                   thinking)
        except ValueError as e:
            param = ("reasoning_effort" if reasoning_effort is not None
                     else "thinking" if thinking is not None else "chat_template_kwargs")
            raise bad_request(str(e), param) from e

    async def render(self, messages: list[dict[str, Any]], *, level: str, tools: Any = None, tool_choice: Any = None,
                     response_format: Any = None, add_generation_prompt: bool = True,
                     continue_final_message: bool = False) -> tuple[RenderedPrompt, list[int]]:
        """(prompt, token ids) of a conversation at thinking ``level``; malformed messages are 400s.
        Images are loaded and placed here (``prompt.image_items``; bad images are 400s naming
        the problem). Runs on a worker thread: a long agent context must not stall the other
        streams, nor an image fetch or resize."""
        fmt = self.need_chat()

        def work() -> tuple[RenderedPrompt, list[int]]:
            prompt = fmt.render(messages, tools=tools, tool_choice=tool_choice, response_format=response_format,
                                thinking=level, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message)
            ids, prompt.image_items = encode_with_images(prompt, self.tokenizer, self.model_config.vision,
                                                         self.config.image_limits)
            return prompt, ids

        try:
            return await asyncio.to_thread(work)
        except ValueError as e:
            raise bad_request(str(e), "messages") from e

    async def encode(self, text: str) -> list[int]:
        """User text to token ids (never special ids), on a worker thread."""
        return await asyncio.to_thread(self.need_tokenizer().encode, text)

    def chat_stop_ids(self, ignore_eos: bool) -> list[int]:
        """The chat format's stop tokens the engine does not already stop on (none with ignore_eos,
        which bench clients send to get exactly max_tokens)."""
        if ignore_eos or self.chat is None:
            return []
        return [t for t in self.chat.stop_token_ids(self.tokenizer) if t not in self.engine.eos_token_ids]

    async def constrain(self, params: SamplingParams, spec: StructuredOutputsParams | None, param: str) -> None:
        """Compile ``spec`` on a worker thread (a complex schema takes a while) to refuse an invalid
        one with a 400 before it is queued, and set it on ``params``; the engine core compiles it too."""
        if spec is None:
            return
        try:
            await asyncio.to_thread(self.grammar_compiler().compile, spec)
        except ValueError as e:
            raise bad_request(str(e), param) from e
        params.structured_outputs = spec

    def reply_constraint(self, prompt: RenderedPrompt, *, tools: Any, tool_choice: Any,
                         content: StructuredOutputsParams | None, parallel_tool_calls: bool | None = None,
                         skeleton: bool = False) -> StructuredOutputsParams | None:
        """The grammar of a chat reply in the checkpoint's format (tools, tool_choice, the
        response body's format), with the points where the engine picks a tool name whole (under
        --tool-name-choice whole). ``skeleton``: a reply the generation prompt opened that may
        end (no ignore_eos) is held to the format's skeleton even when the request constrains
        nothing, so it cannot call a tool nobody declared (K3; K2 replies stay free)."""
        chat = self.need_chat()
        try:
            grammar = chat.reply_grammar(prompt, tools=tools, tool_choice=tool_choice, content=content,
                                         parallel_tool_calls=parallel_tool_calls, skeleton=skeleton)
            whole = grammar is not None and self.config.tool_name_choice == "whole"
            points = chat.reply_choice_points(tools=tools, tool_choice=tool_choice) if whole else ()
        except ValueError as e:
            raise bad_request(str(e), "tool_choice" if "tool" in str(e) else "response_format") from e
        return StructuredOutputsParams(llguidance=grammar, choice_points=points) if grammar is not None else None

    async def submit(self, requests: list[EngineRequest], *, prompt_param: str = "messages",
                     max_tokens_param: str = "max_tokens") -> RequestStream:
        """Queue requests; context overflow (naming the request's own fields), invalid input and a
        stopped engine become API errors."""
        limit = self.max_model_len
        params = {"prompt_param": prompt_param, "max_tokens_param": max_tokens_param}
        for r in requests:
            n, m = len(r.prompt_token_ids), r.params.max_tokens
            if (m is None and n >= limit) or (m is not None and n + m > limit):
                raise context_length_error(limit, n, m, **params)
        try:
            return await self.client.generate(requests)
        except RequestTooLongError as e:
            r = requests[0]
            raise context_length_error(limit, len(r.prompt_token_ids), r.params.max_tokens, **params) from e
        except EngineError as e:
            raise APIError(503, str(e)) from e
        except QueueFullError as e:
            raise APIError(503, str(e), retry_after=QUEUE_FULL_RETRY_AFTER_S) from e
        except ValueError as e:
            raise bad_request(str(e)) from e


def widest(*counts: int | None) -> int | None:
    """The most alternatives any of ``counts`` asks for (-1: the whole vocabulary; None: none)."""
    given = [c for c in counts if c is not None]
    return None if not given else -1 if -1 in given else max(given)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, stream: RequestStream) -> list[TokenDelta]:
    """All deltas of a non-streaming request; aborts it if the client disconnects first."""

    async def drain() -> list[TokenDelta]:
        return [d async for d in stream]

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        stream.close()
    if not work.done() or work.cancelled():
        raise APIError(499, "the client disconnected")
    try:
        return work.result()
    except EngineError as e:
        raise APIError(e.status, str(e)) from e


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


class Guard:
    """ASGI middleware in front of every route: the API key (``Authorization: Bearer`` or
    ``x-api-key``) and the request size limit (413), answered in the route's envelope. The body is
    read here once and handed on, so later reads of ``receive`` see the client's disconnect."""

    def __init__(self, app: Any, api_key: str | None, max_bytes: int, public: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app = app
        self.api_key = api_key
        self.max_bytes = max_bytes
        self.public = public

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and path not in self.public and not self._authorized(headers):
            err = APIError(401, "invalid or missing API key", code="invalid_api_key")
            return await _send_error(send, err, path)
        too_big = APIError(413, f"the request body is larger than {self.max_bytes} bytes")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await _discard_body(receive, self.max_bytes)
            return await _send_error(send, too_big, path)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                if message.get("more_body"):
                    await _discard_body(receive, self.max_bytes)
                return await _send_error(send, too_big, path)
            chunks.append(body)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        key = headers.get("x-api-key")
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            key = auth[7:].strip()
        return key is not None and hmac.compare_digest(key.encode(), self.api_key.encode())


async def _discard_body(receive: Any, limit: int) -> None:
    """Read and drop up to a few times ``limit`` more bytes, so a client still uploading sees the
    413 instead of a reset connection; past that the connection is simply closed."""
    seen = 0
    while seen < 4 * limit + (1 << 20):
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return
        seen += len(message.get("body", b""))


async def _send_error(send: Any, err: APIError, path: str) -> None:
    body = error_bytes(err, path)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(client: EngineClient, config: ServerConfig, tokenizer: Any, model_config: ModelConfig) -> FastAPI:
    """The app over a started engine core; the app's lifespan reads its frames, and stops it.
    The :class:`ServerState` is ``app.state.tidal`` (the CLI's signal handling reaches the client
    through it)."""
    st = ServerState(client, config, tokenizer, model_config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        st.client.start()
        stats = (asyncio.ensure_future(log_stats(st.client.stats, config.stats_interval))
                 if config.stats_interval > 0 else None)
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            await st.client.stop()

    app = FastAPI(title="tidal", version=tidal.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tidal = st
    install_error_handlers(app)
    app.add_middleware(Guard, api_key=config.api_key, max_bytes=config.max_request_bytes,
                       public=(PUBLIC_PATHS | UI_PATHS) if config.ui else PUBLIC_PATHS)
    if config.ui:
        add_ui_routes(app)
    defaults = config.generation_defaults

    # ---- probes and admin ---------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not st.client.alive:
            raise APIError(503, f"the engine is not running: {st.client.dead or 'stopped'}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": tidal.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = st.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/server_info")
    async def server_info() -> dict:
        e = st.engine
        engine_metrics = st.client.stats().metrics
        return {
            "version": tidal.__version__, "model_path": config.model_path,
            "served_model_name": st.model_name, "max_model_len": st.max_model_len,
            "context_length": e.max_model_len, "max_num_batched_tokens": e.max_num_batched_tokens,
            "page_size": e.layout.page_size, "dtype": e.dtype, "device": e.device,
            "engine_core_pid": e.pid,
            "chat_format": st.chat.name if st.chat else None, "pool": dataclasses.asdict(e.layout),
            "engine": dataclasses.asdict(engine_metrics),
            "internal_states": [{"avg_spec_accept_length": engine_metrics.avg_spec_accept_length}], **config.info,
        }

    @app.post("/flush_cache")
    async def flush_cache(timeout: float = 60.0) -> Response:
        """SGLang's: drop the prefix cache once running requests have finished (bench clients
        call it between warmup and the measured run)."""
        try:
            flushed = await st.client.flush_prefix_cache(timeout)
        except TimeoutError as e:
            raise bad_request(f"cache not flushed: {e}", "timeout") from e
        text = "Cache flushed.\n" if flushed else "Prefix caching is off: nothing to flush.\n"
        return Response(text, media_type="text/plain")

    # ---- models -------------------------------------------------------------------------------
    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "tidal", "root": config.model_path,
                "parent": None, "max_model_len": st.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in config.served_model_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        st.check_model(name)
        return model_card(name)

    # ---- tokenizer ----------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(body: proto.TokenizeRequest) -> dict:
        if body.model is not None:
            st.check_model(body.model)
        tok = st.need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages")
        if body.messages is not None:
            level = st.chat_effort(body.reasoning_effort, body.chat_template_kwargs)
            proto.check_continuation(body.continue_final_message, body.add_generation_prompt)
            _, ids = await st.render([m.model_dump(exclude_none=True) for m in body.messages], level=level,
                                     tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                                     add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message)
        else:
            ids = await st.encode(body.prompt)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tok.decode([t]) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: proto.DetokenizeRequest) -> dict:
        if body.model is not None:
            st.check_model(body.model)
        tok = st.need_tokenizer()
        vocab = model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})", "tokens")
        return {"prompt": tok.decode(body.tokens)}

    # ---- OpenAI -------------------------------------------------------------------------------
    async def start_chat(body: proto.ChatCompletionRequest) -> tuple[RequestStream, dict[str, oai.ChatAccumulator]]:
        """Validate, render and submit one chat request: its stream and one accumulator per choice."""
        st.check_model(body.model)
        body.check_supported()
        level = st.chat_effort(body.reasoning_effort, body.chat_template_kwargs, body.thinking)
        prompt, ids = await st.render(body.message_dicts(), level=level, tools=body.tool_dicts(),
                                      tool_choice=body.tool_choice, response_format=body.response_format,
                                      add_generation_prompt=body.add_generation_prompt,
                                      continue_final_message=body.continue_final_message)
        params = body.sampling_params(body.max_output_tokens, body.num_logprobs, defaults, skip_special_tokens=False,
                                      prompt_logprobs=body.prompt_logprobs)
        # A continued message ends in its own text: heal it like a completion's text prompt.
        params.token_healing = body.continue_final_message and body.heal(config.token_healing)
        params.stop_token_ids = [*params.stop_token_ids, *st.chat_stop_ids(params.ignore_eos)]
        # A continued message keeps its token healing (which a grammar would replace) and stays free.
        spec = st.reply_constraint(prompt, tools=body.tool_dicts(), tool_choice=body.tool_choice,
                                   content=body.content_constraint(), parallel_tool_calls=body.parallel_tool_calls,
                                   skeleton=(body.add_generation_prompt and not body.continue_final_message
                                             and not params.ignore_eos))
        await st.constrain(params, spec, "response_format")
        rid = oai.new_id("chatcmpl")
        samples = sample_requests(rid, ids, params, images=prompt.image_items)
        stream = await st.submit(samples, max_tokens_param=body.max_tokens_field)
        opts = oai.ChatOptions(
            id=rid, model=body.model, created=oai.now(), num_logprobs=body.num_logprobs,
            include_usage=body.include_usage or (body.stream and config.force_include_usage),
            continuous_usage=body.continuous_usage or (body.stream and config.force_include_usage),
            include_reasoning=body.include_reasoning, reasoning_alias=config.reasoning_alias,
            token_bytes=getattr(st.tokenizer, "token_bytes", None),
            tokens_as_ids=bool(body.return_tokens_as_token_ids or config.tokens_as_ids),
            prompt_token_ids=ids if body.return_token_ids else None,
            num_prompt_logprobs=body.prompt_logprobs,
        )
        return stream, {r.request_id: oai.ChatAccumulator(st.chat.parser(prompt.thinking), opts, i)
                        for i, r in enumerate(samples)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: proto.ChatCompletionRequest, request: Request) -> Any:
        stream, accs = await start_chat(body)
        if body.stream:
            return sse_response(oai.framed(oai.chat_stream(stream, accs), stream))
        return oai.chat_response(await collect(request, stream), accs)

    @app.post("/v1/completions")
    async def completions(body: proto.CompletionRequest, request: Request) -> Any:
        st.check_model(body.model)
        body.check_supported()
        cid = oai.new_id("cmpl")
        prompts = body.prompts()
        constraint = body.content_constraint()
        requests, echo, prompt_ids = [], [], []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                ids, text = await st.encode(p), p
            else:
                ids, text = p, None
            if body.echo and text is None and st.tokenizer is not None:
                text = st.tokenizer.decode(ids)
            prompt_lp = widest(body.logprobs if body.echo else None, body.prompt_logprobs)
            params = body.sampling_params(body.max_tokens, body.logprobs, defaults, prompt_logprobs=prompt_lp)
            params.token_healing = isinstance(p, str) and body.heal(config.token_healing)
            await st.constrain(params, constraint, "structured_outputs")
            for r in sample_requests(f"{cid}-{i}", ids, params, prompt=text):
                requests.append(r)
                echo.append((text or "") if body.echo else None)
                prompt_ids.append(ids)
        stream = await st.submit(requests, prompt_param="prompt")
        opts = oai.CompletionOptions(
            id=cid, model=body.model, created=oai.now(), index_of={r.request_id: i for i, r in enumerate(requests)},
            echo_text=echo, prompt_ids=prompt_ids, num_logprobs=body.logprobs,
            include_usage=body.include_usage or (body.stream and config.force_include_usage),
            continuous_usage=body.continuous_usage or (body.stream and config.force_include_usage), n=body.n,
            tokens_as_ids=bool(body.return_tokens_as_token_ids or config.tokens_as_ids),
            return_token_ids=bool(body.return_token_ids), num_prompt_logprobs=body.prompt_logprobs,
        )
        piece = ((lambda t: st.tokenizer.decode([t])) if st.tokenizer is not None and not opts.tokens_as_ids
                 else (lambda t: f"token_id:{t}"))
        acc = oai.CompletionAccumulator(opts, piece)
        if body.stream:
            return sse_response(oai.framed(oai.completion_stream(stream, acc), stream))
        return oai.completion_response(await collect(request, stream), acc)

    responses_api.register(app, st)
    vllm_routes.register(app, start_chat, chat_completions, completions)

    # ---- Anthropic ----------------------------------------------------------------------------
    async def render_messages(body: anth.MessagesRequest | anth.CountTokensRequest
                              ) -> tuple[RenderedPrompt, list[int]]:
        return await st.render(anth.to_chat_messages(body), tools=anth.to_chat_tools(body),
                               tool_choice=anth.to_tool_choice(body.tool_choice),
                               level=anth.effort_of(body, config.default_reasoning_effort))

    @app.post("/v1/messages")
    async def messages(body: anth.MessagesRequest, request: Request) -> Any:
        st.check_model(body.model)
        prompt, ids = await render_messages(body)
        params = body.sampling_params(defaults)
        params.stop_token_ids = [*params.stop_token_ids, *st.chat_stop_ids(params.ignore_eos)]
        choice = body.tool_choice or {}
        spec = st.reply_constraint(prompt, tools=anth.to_chat_tools(body), tool_choice=anth.to_tool_choice(choice),
                                   content=anth.output_format(body),
                                   parallel_tool_calls=False if choice.get("disable_parallel_tool_use") else None,
                                   skeleton=not params.ignore_eos)
        await st.constrain(params, spec, "tool_choice")
        mid = oai.new_id("msg", sep="_")
        stream = await st.submit([EngineRequest(mid, ids, params, images=prompt.image_items)])
        parser = st.chat.parser(prompt.thinking, anth.new_tool_id)
        opts = anth.MessagesOptions(id=mid, model=body.model, prompt_tokens=len(ids))
        if body.stream:
            return sse_response(anth.messages_stream(stream, parser, opts))
        return anth.messages_response(await collect(request, stream), parser, opts)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: anth.CountTokensRequest) -> dict:
        st.check_model(body.model)
        _, ids = await render_messages(body)
        return {"input_tokens": len(ids)}

    return app
