"""``tidal bench``: a serving benchmark client for any OpenAI-compatible server.

Imports nothing from the engine. Layout: datasets.py (random, trace), multiturn.py (agent
sessions), text.py (synthetic text), tokenizer.py, client.py (httpx streaming), records.py
(what a request leaves behind), load.py (open and closed loops), metrics.py, report.py, cli.py."""

from tidal.bench.client import OpenAIClient
from tidal.bench.datasets import BenchRequest, random_requests, trace_requests
from tidal.bench.metrics import request_metrics, summarize
from tidal.bench.records import Chunk, RequestRecord

__all__ = ["BenchRequest", "Chunk", "OpenAIClient", "RequestRecord", "random_requests", "request_metrics",
           "summarize", "trace_requests"]
