"""Synthetic coding-agent sessions for the closed-loop multi-turn benchmark.

All sessions of a row share one system prompt and one tool list (the prefix a real agent fleet
shares). Each session starts with a unique task, then alternates the server's real reply (fed
back verbatim, with any tool calls it made) and a tool result of realistic size: file reads,
grep hits, test logs, listings, edit confirmations, with log-normal sizes. A session ends after
its drawn number of turns or before its context would overflow."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tidal.bench import text
from tidal.bench.datasets import BenchRequest
from tidal.bench.records import RequestRecord
from tidal.bench.tokenizer import BenchTokenizer


def _fn(name: str, description: str, **params: str) -> dict:
    props = {k: {"type": "integer" if k in ("start_line", "end_line", "timeout") else "string", "description": v}
             for k, v in params.items()}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": list(params)[:1]}}}


TOOLS = [
    _fn("bash", "Run a shell command in the repository and return its stdout and stderr.",
        command="The command line to run.", timeout="Seconds before the command is killed."),
    _fn("read_file", "Read a file, optionally a line range; lines come back numbered.",
        path="File path relative to the repository root.", start_line="First line.", end_line="Last line."),
    _fn("write_file", "Create or overwrite a file with the given content.",
        path="File path.", content="The full new content."),
    _fn("edit_file", "Replace one exact occurrence of old_text with new_text in a file.",
        path="File path.", old_text="Text to replace, matched exactly.", new_text="Replacement text."),
    _fn("grep", "Search file contents with a regular expression; returns path:line:text hits.",
        pattern="Regular expression.", path="Directory or file to search."),
    _fn("glob", "List files matching a glob pattern.", pattern="Glob pattern such as src/**/*.py."),
    _fn("run_tests", "Run the test suite or a subset and return the log.", selector="pytest node id or path."),
    _fn("web_fetch", "Fetch a URL and return its text content.", url="The URL."),
]

# (tool name, generator, share of calls, size relative to the median tool result)
TOOL_RESULTS = [
    ("read_file", text.code, 0.35, 1.6),
    ("grep", text.grep_hits, 0.20, 0.6),
    ("run_tests", text.test_log, 0.20, 1.0),
    ("glob", text.listing, 0.10, 0.3),
    ("edit_file", None, 0.15, 0.15),
]

SYSTEM_HEADER = (
    "You are a coding agent working inside a software repository. You can call tools to read and "
    "edit files, search the code and run commands. Work in small verified steps: read before you "
    "edit, run the tests after every change, and report what you changed and why. Never invent "
    "file contents; if you are unsure, read the file again.\n\n# Guidelines\n"
)


@dataclass
class AgentConfig:
    """Token sizes are approximate (sized by characters with a measured chars/token ratio)."""

    system_len: int = 4000          # system prompt tokens, before the tool list
    tool_result_len: int = 500      # median tool-result tokens
    task_len: int = 150             # median tokens of a session's opening user message
    output_len: int = 220           # median assistant tokens per turn
    turns: tuple[int, int] = (10, 40)
    max_context: int = 131072       # a session ends before its next request would exceed this
    num_tools: int = len(TOOLS)     # tools in the shared list (0: send none)
    chars_per_token: float = 4.0


def measure_chars_per_token(tokenizer: BenchTokenizer | None, seed: int = 0) -> float:
    """Characters per token on agent-shaped text (code, logs, prose); 4.0 without a tokenizer."""
    if tokenizer is None:
        return 4.0
    rng = np.random.default_rng(seed)
    sample = "\n".join([text.code(rng, 60), text.grep_hits(rng, 30), text.test_log(rng, 30), text.words(rng, 300)])
    return len(sample) / max(len(tokenizer.encode(sample)), 1)


def lognormal_len(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(round(rng.lognormal(math.log(max(median, 1.0)), sigma)), lo, hi))


class AgentWorkload:
    """The shared prefix (system prompt + tools) of one row, and a factory of its sessions."""

    def __init__(self, cfg: AgentConfig, seed: int = 0, salt: int = 0) -> None:
        self.cfg, self.seed, self.salt = cfg, seed, salt
        rng = np.random.default_rng([seed, salt])
        target = int(cfg.system_len * cfg.chars_per_token)
        rules, n = [], len(SYSTEM_HEADER)
        while n < target:
            rule = f"{len(rules) + 1}. {text.words(rng, int(rng.integers(12, 40)))}"
            rules.append(rule)
            n += len(rule) + 1
        self.system_prompt = (SYSTEM_HEADER + "\n".join(rules))[: max(target, 1)]
        self.tools = TOOLS[: cfg.num_tools] or None
        self.sessions_started = 0

    def new_session(self) -> Session:
        self.sessions_started += 1
        return Session(self, self.sessions_started - 1)


class Session:
    """One agent conversation. ``next_request`` gives the whole history so far; ``add_reply``
    feeds the server's reply back and appends the next tool result."""

    def __init__(self, workload: AgentWorkload, index: int) -> None:
        self.w, self.cfg, self.index = workload, workload.cfg, index
        self.rng = np.random.default_rng([workload.seed, workload.salt, index + 1])
        lo, hi = self.cfg.turns
        self.n_turns = int(self.rng.integers(lo, hi + 1))
        self.turn = 0
        self.done = False
        n_words = lognormal_len(self.rng, self.cfg.task_len * self.cfg.chars_per_token / 6, 0.5, 3, 10**6)
        task = (f"Task {index}: in {text.path(self.rng)}, {text.words(self.rng, n_words)} "
                f"The failing test is {text.path(self.rng)}::test_{text.ident(self.rng)}.")
        self.messages: list[dict] = [
            {"role": "system", "content": workload.system_prompt},
            {"role": "user", "content": task},
        ]
        self._est_tokens = self._tokens(workload.system_prompt) + self._tokens(task) + 200 * len(workload.tools or [])

    def _tokens(self, s: str) -> int:
        return int(len(s) / self.cfg.chars_per_token) + 1

    def next_request(self) -> BenchRequest:
        out = lognormal_len(self.rng, self.cfg.output_len, 0.6, 1, 8 * self.cfg.output_len)
        return BenchRequest(messages=list(self.messages), tools=self.w.tools, input_len=self._est_tokens,
                            output_len=out, meta={"session": self.index, "turn": self.turn})

    def add_reply(self, rec: RequestRecord) -> None:
        msg: dict = {"role": "assistant", "content": rec.content}
        if rec.reasoning:
            msg["reasoning_content"] = rec.reasoning
        if rec.tool_calls:
            msg["tool_calls"] = rec.tool_calls
        self.messages.append(msg)
        self.turn += 1
        prompt = rec.prompt_tokens if rec.prompt_tokens is not None else self._est_tokens
        out = rec.completion_tokens if rec.completion_tokens is not None else self._tokens(rec.content + rec.reasoning)
        if self.turn >= self.n_turns:
            self.done = True
            return
        results = [self._tool_result() for _ in (rec.tool_calls or [None])]
        if rec.tool_calls:
            for call, (_, body) in zip(rec.tool_calls, results):
                self.messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": body})
        else:
            name, body = results[0]
            self.messages.append({"role": "user", "content": f"[{name} result]\n{body}"})
        self._est_tokens = prompt + out + sum(self._tokens(b) + 8 for _, b in results)
        if self._est_tokens + 8 * self.cfg.output_len > self.cfg.max_context:
            self.done = True

    def _tool_result(self) -> tuple[str, str]:
        shares = np.array([s for _, _, s, _ in TOOL_RESULTS])
        name, gen, _, scale = TOOL_RESULTS[int(self.rng.choice(len(TOOL_RESULTS), p=shares / shares.sum()))]
        median = self.cfg.tool_result_len * scale
        n_tok = lognormal_len(self.rng, median, 0.9, 8, 16 * self.cfg.tool_result_len)
        n_chars = int(n_tok * self.cfg.chars_per_token)
        if gen is None:
            body = f"Edited {text.path(self.rng)}: replaced 1 occurrence.\n" + text.sized(text.code, self.rng, n_chars)
        else:
            body = text.sized(gen, self.rng, n_chars)
        return name, body[: max(n_chars, 1)]
