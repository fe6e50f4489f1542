"""tidal bench metrics on recorded streams with known timestamps, against hand-computed values;
and the client's SSE parsing and error classes on recorded byte streams replayed through httpx."""

import asyncio
import json

import httpx
import numpy as np
import pytest

from tidal.bench.client import OpenAIClient, classify_error
from tidal.bench.datasets import BenchRequest
from tidal.bench.metrics import request_metrics, spread_counts, summarize
from tidal.bench.records import Chunk, RequestRecord

approx = pytest.approx


def rec(chunks, end, completion=None, prompt=None, send=0.0, error_class="", cached=None):
    return RequestRecord(send_time=send, chunks=chunks, end=end, completion_tokens=completion, prompt_tokens=prompt,
                         error_class=error_class, cached_tokens=cached, input_len=7)


def test_multi_token_chunk_spreads_its_gap_by_usage_and_characters():
    # role-only chunk and an empty chunk carry no token; "cdef" is 4 of the 7 usage tokens.
    r = rec([Chunk(0.05), Chunk(0.10, "a"), Chunk(0.20, "b"), Chunk(0.25, ""), Chunk(0.50, "cdef"), Chunk(0.60, "g")],
            end=0.70, completion=7, prompt=12)
    m = request_metrics(r, itl_rule="token")
    assert m.ttft == approx(0.10) and m.ttfc == approx(0.10) and m.e2e == approx(0.70)
    assert m.itl == approx([0.10, 0.075, 0.075, 0.075, 0.075, 0.10])
    # SGLang's and vLLM's OpenAI clients: one gap per token chunk, the held-back "cdef" one long gap.
    assert request_metrics(r).itl == approx([0.10, 0.30, 0.10])
    assert m.tpot == approx((0.70 - 0.10) / 6)
    assert (m.input_tokens, m.output_tokens) == (12, 7)


def test_usage_total_apportioned_with_at_least_one_token_per_chunk():
    # 5 tokens over chars [1, 1, 4, 1]: exact [.71, .71, 2.86, .71] -> largest remainder [1, 1, 3, 0]
    # -> the empty chunk takes one from the largest: [1, 1, 2, 1].
    assert spread_counts(5, [1, 1, 4, 1]) == [1, 1, 2, 1]
    assert spread_counts(10, [1, 1, 1]) == [4, 3, 3]
    assert spread_counts(3, [5, 9, 2]) == [1, 1, 1]
    m = request_metrics(rec([Chunk(0.1, "a"), Chunk(0.2, "b"), Chunk(0.5, "cdef"), Chunk(0.6, "g")], 0.7, completion=5),
                        itl_rule="token")
    assert m.itl == approx([0.10, 0.15, 0.15, 0.10])
    assert m.tpot == approx(0.6 / 4)


def test_exact_token_counts_from_the_server_win():
    chunks = [Chunk(0.1, "a", n_tokens=1), Chunk(0.2, "b", n_tokens=1), Chunk(0.25, ""),
              Chunk(0.5, "cdef", n_tokens=3), Chunk(0.6, "g", n_tokens=1)]
    m = request_metrics(rec(chunks, 0.7, completion=6), itl_rule="token")
    assert m.itl == approx([0.1] * 5)
    assert request_metrics(rec(chunks, 0.7, completion=6)).itl == approx([0.1, 0.3, 0.1])
    assert m.tpot == approx(0.12)
    # Without usage the output length is the sum of the exact counts.
    assert request_metrics(rec(chunks, 0.7)).output_tokens == 6


def test_reasoning_only_start_separates_ttft_and_ttfc():
    r = rec([Chunk(0.02), Chunk(0.10, reasoning="Let"), Chunk(0.15, reasoning=" me"), Chunk(0.40, "Hi"),
             Chunk(0.45, "!")], end=0.5, completion=4)
    m = request_metrics(r)
    assert m.ttft == approx(0.10) and m.ttfc == approx(0.40)
    assert m.itl == approx([0.05, 0.25, 0.05])
    assert m.tpot == approx(0.4 / 3)
    only = request_metrics(rec([Chunk(0.1, reasoning="x"), Chunk(0.3, reasoning="y")], end=0.35, completion=2))
    assert only.ttfc is None and only.tpot == approx(0.25)
    tool = request_metrics(rec([Chunk(0.1, reasoning="x"), Chunk(0.2, tool='grep{"p"')], end=0.3, completion=2))
    assert tool.ttfc == approx(0.2)


def test_failed_requests_stay_out_of_latencies_and_tokens():
    ok1 = rec([Chunk(0.1, "a"), Chunk(0.3, "b"), Chunk(0.5, "c")], 0.6, completion=3, prompt=100, send=10.6, cached=50)
    ok2 = rec([Chunk(0.3, "x"), Chunk(0.4, "yz")], 0.9, completion=3, prompt=200, send=10.8)
    http = rec([], 0.05, send=10.2, error_class="http_500")
    mid = rec([Chunk(0.05, "zz"), Chunk(0.1, "q")], 0.2, send=10.1, error_class="midstream")
    empty = rec([Chunk(0.1)], 0.2, send=10.22)  # a 200 stream that never carried a token
    row = summarize([ok1, http, mid, ok2, empty], 2.0, cut=1, row_start=10.0, details=True, itl_rule="token")
    assert (row["completed"], row["failed"], row["cut"]) == (2, 3, 1)
    assert row["error_classes"] == {"http_500": 1, "midstream": 1, "empty_stream": 1}
    assert (row["total_input_tokens"], row["total_output_tokens"]) == (300, 6)
    assert row["total_cached_tokens"] == 50 and row["cache_hit_rate"] == approx(0.5)
    assert row["request_throughput"] == approx(1.0) and row["input_throughput"] == approx(150.0)
    assert row["output_throughput"] == approx(3.0) and row["total_throughput"] == approx(153.0)
    # TTFT 100 and 300 ms; np.percentile interpolates linearly between them.
    assert [row[f"{s}_ttft_ms"] for s in ("mean", "median", "std", "p90", "p95", "p99", "max")] == approx(
        [200, 200, 100, 280, 290, 298, 300])
    assert row["median_ttfc_ms"] == approx(200)
    # ITL: ok1 [200, 200]; ok2 "yz" is 2 of its 3 tokens, so its 100 ms gap is [50, 50].
    itl = [row[f"{s}_itl_ms"] for s in ("mean", "median", "p90", "max")]
    assert itl == approx([125, 125, 200, 200])
    # Per chunk, ok2's 100 ms gap is one value: [200, 200, 100].
    by_chunk = summarize([ok1, http, mid, ok2, empty], 2.0, cut=1, row_start=10.0)
    assert [by_chunk[f"{s}_itl_ms"] for s in ("mean", "median", "max")] == approx([500 / 3, 200, 200])
    assert row["mean_tpot_ms"] == approx(275) and row["mean_e2e_latency_ms"] == approx(750)
    assert row["concurrency"] == approx((0.6 + 0.9) / 2.0)
    # tokens at 10.7, 10.9 | 11.1 (ok1) and 11.1, 11.2 x2 (ok2): second 1 holds 4.
    assert row["max_output_tokens_per_s"] == 4
    # in flight: mid [10.1, 10.3], http [10.2, 10.25], empty [10.22, 10.42] overlap three deep.
    assert row["max_concurrent_requests"] == 3
    assert row["input_lens"] == [100, 200] and row["ttfts"] == approx([0.1, 0.3]) and len(row["errors"]) == 3


def test_no_completed_request_gives_empty_stats():
    row = summarize([rec([], 0.1, error_class="timeout")], 1.0)
    assert row["completed"] == 0 and row["median_ttft_ms"] is None and row["output_throughput"] == 0


# --- the client on recorded byte streams -----------------------------------------------------

def sse(*objs) -> bytes:
    lines = [": ping\n\n"] + [f"data: {o if isinstance(o, str) else json.dumps(o)}\n\n" for o in objs]
    return "".join(lines).encode()


def send(handler, endpoint="chat", timeout=5.0, req=None):
    async def go():
        client = OpenAIClient("http://bench.test/v1", "m", endpoint=endpoint, timeout=timeout,
                              transport=httpx.MockTransport(handler))
        async with client:
            return await client.send(req or BenchRequest(prompt="hi", input_len=1, output_len=6))
    return asyncio.run(go())


def test_chat_stream_parsing_reasoning_tools_usage():
    seen = {}
    body = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
               {"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]},
               {"choices": [{"index": 0, "delta": {"reasoning": " more"}}]},
               {"choices": [{"index": 0, "delta": {"content": "Hello"}}]},
               {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                                    "function": {"name": "grep", "arguments": ""}}]}}]},
               {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                                                                    "function": {"arguments": '{"p": 1}'}}]}}]},
               {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
               {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 6,
                                         "prompt_tokens_details": {"cached_tokens": 8}}},
               "[DONE]")

    def handler(request):
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    r = send(handler)
    assert r.ok and r.reasoning == "think more" and r.content == "Hello"
    assert r.tool_calls == [{"id": "call_1", "type": "function", "function": {"name": "grep", "arguments": '{"p": 1}'}}]
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (12, 6, 8)
    assert sum(c.has_token for c in r.chunks) == 5 and sum(c.has_answer for c in r.chunks) == 3
    b = seen["body"]
    assert seen["path"] == "/v1/chat/completions" and b["messages"] == [{"role": "user", "content": "hi"}]
    assert b["max_completion_tokens"] == 6 and b["stream_options"] == {"include_usage": True} and b["ignore_eos"]


def test_completions_stream_counts_tokens_from_logprobs():
    body = sse({"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]}}]},
               {"choices": [{"index": 0, "text": "c", "logprobs": {"tokens": ["c"]}}]}, "[DONE]")
    r = send(lambda req: httpx.Response(200, content=body), endpoint="completions",
             req=BenchRequest(prompt=[5, 6, 7], input_len=3, output_len=3))
    assert r.ok and [c.n_tokens for c in r.chunks] == [2, 1] and r.content == "abc"
    assert request_metrics(r).output_tokens == 3


@pytest.mark.parametrize("status,body,expected", [
    (400, {"error": {"message": "This model's maximum context length is 8192 tokens. However, you requested 9000",
                     "code": 400}}, "context_overflow"),
    (503, {"error": {"message": "overloaded"}}, "http_503"),
    (404, "not found", "http_404"),
])
def test_http_errors_are_classified(status, body, expected):
    content = json.dumps(body).encode() if isinstance(body, dict) else body.encode()
    r = send(lambda req: httpx.Response(status, content=content))
    assert r.error_class == expected and not r.ok


def test_stream_failures_are_classified():
    mid = sse({"choices": [{"index": 0, "delta": {"content": "a"}}]},
              {"error": {"message": "engine died", "code": 500}})
    assert send(lambda req: httpx.Response(200, content=mid)).error_class == "midstream"
    empty = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}, "[DONE]")
    assert send(lambda req: httpx.Response(200, content=empty)).error_class == "empty_stream"

    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)
    assert send(refuse).error_class == "connection"

    async def broken():
        yield sse({"choices": [{"index": 0, "delta": {"content": "a"}}]})
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
    r = send(lambda req: httpx.Response(200, content=broken()))
    assert r.error_class == "midstream" and r.content == "a"

    async def slow():
        yield sse({"choices": [{"index": 0, "delta": {"content": "a"}}]})
        await asyncio.sleep(5)
    assert send(lambda req: httpx.Response(200, content=slow()), timeout=0.2).error_class == "timeout"


def test_error_text_decides_context_overflow():
    assert classify_error(400, "Prompt is too long: 9000 tokens") == "context_overflow"
    assert classify_error(400, "bad temperature") == "http_400"


# --- load generation: arrival schedules, concurrency cap, deadline cuts -----------------------

def test_arrival_schedules():
    from tidal.bench.load import arrival_times
    assert arrival_times(4, float("inf")).tolist() == [0, 0, 0, 0]
    poisson = arrival_times(20000, 50.0, 1.0, seed=1)
    gaps = np.diff(poisson)
    assert poisson[0] == 0 and gaps.mean() == approx(1 / 50, rel=0.03)
    assert gaps.std() / gaps.mean() == approx(1.0, rel=0.05)            # exponential: CV 1
    bursty = np.diff(arrival_times(20000, 50.0, 0.25, seed=1))
    assert bursty.mean() == approx(1 / 50, rel=0.05)
    assert bursty.std() / bursty.mean() == approx(2.0, rel=0.08)         # gamma shape k: CV 1/sqrt(k)


def test_open_loop_caps_concurrency_and_cuts_at_the_deadline():
    from tidal.bench.load import run_closed_loop, run_open_loop

    live = {"now": 0, "max": 0}

    async def send(req):
        live["now"] += 1
        live["max"] = max(live["max"], live["now"])
        try:
            await asyncio.sleep(req.output_len / 100)
        finally:
            live["now"] -= 1
        return RequestRecord(chunks=[Chunk(0.01, "x")], end=req.output_len / 100)

    reqs = [BenchRequest(prompt="p", output_len=5) for _ in range(6)]
    run = asyncio.run(run_open_loop(reqs, [0.0] * 6, send, max_concurrency=2))
    assert len(run.records) == 6 and run.cut == 0 and live["max"] == 2
    assert run.duration == approx(0.15, abs=0.05)                        # 3 waves of 50 ms
    # 100 ms requests, 4 in flight, deadline at 0.15 s: 4 complete, 4 are cut, 2 never sent.
    live["max"] = 0
    slow = [BenchRequest(prompt="p", output_len=10) for _ in range(10)]
    run = asyncio.run(run_open_loop(slow, [0.0] * 10, send, max_concurrency=4, max_duration=0.15))
    assert (len(run.records), run.cut) == (4, 4) and run.duration == approx(0.15, abs=0.02)

    class Session:
        def __init__(self):
            self.done, self.n = False, 0

        def next_request(self):
            return BenchRequest(messages=[], output_len=5)

        def add_reply(self, rec):
            self.n += 1
            self.done = self.n == 2

    made = []
    run = asyncio.run(run_closed_loop(lambda: made.append(Session()) or made[-1], send, lanes=3, max_duration=0.125))
    # 50 ms turns: each lane finishes a 2-turn session (at 50, 100 ms), starts a second one and is
    # mid-request at 125 ms, so 6 turns complete, 3 are cut and 6 sessions were made.
    assert (len(run.records), run.cut, len(made)) == (6, 3, 6)
    assert run.duration == approx(0.125, abs=0.02)
