"""Async streaming client for OpenAI-compatible servers (httpx).

Records each SSE chunk's arrival time and classifies every failure: ``http_<status>``,
``context_overflow`` (matched on the error text, whatever the status), ``timeout`` (the
per-request --timeout), ``connection`` (no response), ``midstream`` (an error line or a broken
stream after a 200), ``empty_stream`` (a 200 that carried no token)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from tidal.bench.datasets import BenchRequest
from tidal.bench.records import Chunk, RequestRecord

# Error texts that mean the prompt did not fit (vLLM, SGLang, OpenAI, Anthropic wording).
CONTEXT_OVERFLOW_MARKERS = ("context length", "maximum context", "context_length_exceeded", "prompt is too long",
                            "context window")


def root_url(base_url: str) -> str:
    """Server root: ``--base-url`` may be given with or without a trailing /v1."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def classify_error(status: int | None, message: str) -> str:
    low = message.lower()
    if any(m in low for m in CONTEXT_OVERFLOW_MARKERS):
        return "context_overflow"
    return f"http_{status}" if status is not None else "midstream"


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


class OpenAIClient:
    """One HTTP connection pool for a whole run. ``send`` never raises for a server-side
    failure; it returns a record with ``error_class`` set."""

    def __init__(self, base_url: str, model: str, *, endpoint: str = "completions", api_key: str | None = None,
                 timeout: float = 600.0, ignore_eos: bool = True, temperature: float = 0.0,
                 extra_body: dict | None = None, headers: dict[str, str] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        if endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, got {endpoint!r}")
        self.root = root_url(base_url)
        self.model, self.endpoint, self.timeout = model, endpoint, timeout
        self.ignore_eos, self.temperature = ignore_eos, temperature
        self.extra_body = extra_body or {}
        self.headers = dict(headers or {})
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        self._transport = transport  # replays recorded byte streams in tests
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> OpenAIClient:  # noqa: PYI034
        self._http = httpx.AsyncClient(
            base_url=self.root, headers=self.headers,
            timeout=httpx.Timeout(None, connect=min(60.0, self.timeout)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None), transport=self._transport)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def payload(self, req: BenchRequest) -> dict:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                                "temperature": self.temperature}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "chat":
            if req.messages is None and not isinstance(req.prompt, str):
                raise ValueError("the chat endpoint needs text prompts or messages")
            body["messages"] = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.output_len
            if req.tools:
                body["tools"] = req.tools
        else:
            if req.prompt is None:
                raise ValueError("the completions endpoint needs a prompt (multi-turn runs need --endpoint chat)")
            body["prompt"] = req.prompt
            body["max_tokens"] = req.output_len
        body.update(self.extra_body)
        return body

    async def send(self, req: BenchRequest) -> RequestRecord:
        rec = RequestRecord(input_len=req.input_len, output_len=req.output_len)
        body = self.payload(req)
        rec.send_time = time.perf_counter()
        state: dict = {"status": None}
        try:
            await asyncio.wait_for(self._stream(body, rec, state), self.timeout)
        except asyncio.TimeoutError:
            rec.error_class, rec.error = "timeout", f"no complete response within {self.timeout:g} s"
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            rec.error_class, rec.error = "connection", f"{type(e).__name__}: {e}"
        except httpx.TimeoutException as e:
            rec.error_class, rec.error = "timeout", f"{type(e).__name__}: {e}"
        except (httpx.TransportError, json.JSONDecodeError, UnicodeDecodeError) as e:
            rec.error_class = "midstream" if state["status"] == 200 else "connection"
            rec.error = f"{type(e).__name__}: {e}"
        if not rec.error_class and not any(c.has_token for c in rec.chunks):
            rec.error_class, rec.error = "empty_stream", "status 200 but no token in the stream"
        if rec.end == 0.0:
            rec.end = time.perf_counter() - rec.send_time
        return rec

    async def _stream(self, body: dict, rec: RequestRecord, state: dict) -> None:
        assert self._http is not None, "use 'async with OpenAIClient(...)'"
        tools: dict[int, dict] = {}
        async with self._http.stream("POST", self.path, json=body) as resp:
            state["status"] = resp.status_code
            if resp.status_code != 200:
                raw = (await resp.aread()).decode("utf-8", "replace")
                try:
                    msg = _error_message(json.loads(raw))
                except json.JSONDecodeError:
                    msg = raw
                rec.end = time.perf_counter() - rec.send_time
                rec.error_class, rec.error = classify_error(resp.status_code, msg), msg[:1000]
                return
            async for line in resp.aiter_lines():
                now = time.perf_counter() - rec.send_time
                line = line.strip()
                if not line or line.startswith(":") or not line.startswith("data:"):
                    continue
                rec.end = now
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj and not obj.get("choices"):
                    msg = _error_message(obj)
                    rec.error = msg[:1000]
                    rec.error_class = classify_error(None, msg)  # midstream, or context_overflow by its text
                    return
                self._parse_chunk(obj, now, rec, tools)
        if tools:
            rec.tool_calls = [tools[i] for i in sorted(tools)]

    def _parse_chunk(self, obj: dict, now: float, rec: RequestRecord, tools: dict[int, dict]) -> None:
        usage = obj.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
            rec.completion_tokens = usage.get("completion_tokens", rec.completion_tokens)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec.cached_tokens = int(details["cached_tokens"])
        for choice in obj.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            chunk = Chunk(t=now)
            if self.endpoint == "chat":
                delta = choice.get("delta") or {}
                chunk.content = delta.get("content") or ""
                chunk.reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                for tc in delta.get("tool_calls") or []:
                    slot = tools.setdefault(int(tc.get("index", 0)), {"id": "", "type": "function",
                                                                       "function": {"name": "", "arguments": ""}})
                    slot["id"] = tc.get("id") or slot["id"]
                    fn = tc.get("function") or {}
                    slot["function"]["name"] += fn.get("name") or ""
                    slot["function"]["arguments"] += fn.get("arguments") or ""
                    chunk.tool += (fn.get("name") or "") + (fn.get("arguments") or "")
                logprobs = (choice.get("logprobs") or {}).get("content")
            else:
                chunk.content = choice.get("text") or ""
                logprobs = (choice.get("logprobs") or {}).get("tokens")
            if isinstance(logprobs, list):
                chunk.n_tokens = len(logprobs)
            elif isinstance(choice.get("token_ids"), list):
                chunk.n_tokens = len(choice["token_ids"])
            rec.chunks.append(chunk)
