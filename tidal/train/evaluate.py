"""The embedded model's measured figures (issue "Embedded default model", "Measured"):

- held-out loss and perplexity on the held-out stdlib modules, against a unigram baseline fitted
  on the training tokens;
- the share of greedy completions of held-out function headers that Python's ``ast`` parses;
- the share of held-out tool-use prompts whose reply parses (with the server's K3 parser) into a
  valid tool call naming the right tool;
- (by running the loss on two checkpoints) the gap between the MXFP4 model and its fp32 twin;
- in-context copying: the loss on stdlib spans written a second time against the first writing;
- issue 21's targets, through the engine: bare held-out signatures completed with and without the
  trailing newline (and token-healed), held-out two-/three-tool prompts over tools training never
  declares, and the README's chat example at the model's default effort.
"""

from __future__ import annotations

import ast
import json
import random
import textwrap

import torch
import torch.nn.functional as F

from tidal.model.context import SimpleCache, simple_batch
from tidal.model.kimi import KimiForCausalLM
from tidal.train.conversations import Conversation, heldout_tool_prompts

TOOL_PROMPT_SEED = 1234  # held-out tool prompts: their own seed and held-out entity pools


# ---- loss -------------------------------------------------------------------------------------------


@torch.no_grad()
def stream_loss(model: KimiForCausalLM, stream: torch.Tensor, seq_len: int = 512, batch_size: int = 8) -> tuple[float, int]:
    """Mean next-token loss over ``stream`` cut into consecutive windows of seq_len + 1 tokens
    (each window a fresh sequence; consecutive windows share one boundary token). Returns
    (mean loss in nats, number of predicted tokens)."""
    starts = list(range(0, len(stream) - 1, seq_len))
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        rows = [stream[s : s + seq_len + 1].long() for s in starts[i : i + batch_size]]
        lens = [len(r) - 1 for r in rows]
        cache = SimpleCache(model.config, len(rows), model.dtype)
        batch = simple_batch(model.config, lens, cache, [0] * len(rows))
        logits = model.compute_logits(model(torch.cat([r[:-1] for r in rows]), batch))
        targets = torch.cat([r[1:] for r in rows])
        total += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        count += len(targets)
    return total / count, count


@torch.no_grad()
def copy_loss(model: KimiForCausalLM, stream: torch.Tensor, rows: int = 16, seq_len: int = 256, seed: int = 5
              ) -> tuple[float, float]:
    """In-context copying: (loss on the second writing, loss on the first) of ``stream`` spans each
    written twice in a row (tidal.train.data.copy_row), in nats per token. A model that copies
    scores far below its first-writing loss on the repeats; one that does not scores about the same."""
    from tidal.train.data import copy_row
    from tidal.train.trainer import lm_loss

    losses = []
    for first in (False, True):
        rng = random.Random(seed)
        made = [copy_row(stream, seq_len + 1, rng, first) for _ in range(rows)]
        windows, mask = torch.stack([w for w, _ in made]).long(), torch.stack([m for _, m in made]).bool()
        losses.append(float(lm_loss(model, windows, mask)))
    return losses[0], losses[1]


def unigram_loss(train_counts: torch.Tensor, stream: torch.Tensor) -> float:
    """Cross-entropy of ``stream`` under add-one-smoothed training-token frequencies."""
    p = (train_counts.double() + 1) / (train_counts.sum() + len(train_counts))
    return float(-p.log()[stream[1:].long()].mean())


# ---- greedy generation ------------------------------------------------------------------------------


@torch.no_grad()
def greedy_generate(
    model: KimiForCausalLM, prompts: list[list[int]], max_new: int, stop_ids: set[int]
) -> list[tuple[list[int], bool]]:
    """Greedy continuations of all prompts in one batch (prefill, then batched decode steps).
    Returns (new tokens, whether a stop token ended it) per prompt; the stop token is not included."""
    B = len(prompts)
    cache = SimpleCache(model.config, B, model.dtype)
    batch = simple_batch(model.config, [len(p) for p in prompts], cache, [0] * B)
    hidden = model(torch.tensor([t for p in prompts for t in p]), batch)
    logits = model.compute_logits(hidden[batch.last_token_indices()])
    lengths = [len(p) for p in prompts]
    out: list[list[int]] = [[] for _ in range(B)]
    stopped = [False] * B
    for step in range(max_new):
        nxt = logits.argmax(-1).tolist()
        for b, t in enumerate(nxt):
            if not stopped[b]:
                if t in stop_ids:
                    stopped[b] = True
                else:
                    out[b].append(t)
        if all(stopped) or step == max_new - 1:
            break
        batch = simple_batch(model.config, [1] * B, cache, lengths)
        logits = model.compute_logits(model(torch.tensor(nxt), batch))
        lengths = [n + 1 for n in lengths]
    return list(zip(out, stopped))


# ---- function headers -------------------------------------------------------------------------------


def function_headers(sources: dict[str, str], limit: int, seed: int = 0) -> list[str]:
    """Up to ``limit`` function headers (``def ...:`` lines, dedented, no decorators, no body)
    from ``sources``, a fixed random sample."""
    headers = []
    for _, text in sorted(sources.items()):
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first_body = node.body[0].lineno
            if first_body <= node.lineno:
                continue  # one-line def
            header = textwrap.dedent("\n".join(lines[node.lineno - 1 : first_body - 1])).rstrip()
            if header.endswith(":") and "#" not in header:
                try:
                    ast.parse(header + "\n    pass")
                except SyntaxError:
                    continue
                headers.append(header)
    random.Random(seed).shuffle(headers)
    return headers[:limit]


def completion_parses(header: str, completion: str, ended: bool) -> bool:
    """Whether header + the completion's function body parses. The body runs until the first
    non-blank line back at column 0 (the function ended); a completion cut by the token limit
    loses its last, possibly partial, line. An empty body fails."""
    lines = completion.split("\n")
    if lines and lines[0].strip():
        return False  # the body must start on a new line
    body = []
    finished = ended
    for line in lines[1:]:
        if line.strip() and not line[0].isspace():
            finished = True
            break
        body.append(line)
    if not finished and body:
        body.pop()
    if not any(line.strip() for line in body):
        return False
    try:
        ast.parse(header + "\n" + "\n".join(body))
        return True
    except SyntaxError:
        return False


# ---- tool calls -------------------------------------------------------------------------------------

_TYPES = {"string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,)}


def tool_call_check(reply: str, conv: Conversation) -> tuple[bool, bool]:
    """(valid call naming the right tool, right tool named at all) for one reply, parsed with the
    server's K3 parser. Valid: the first call's arguments are a JSON object with every required
    key, no unknown key, and every value of its declared type."""
    from tidal.serve.chat import K3Format

    parsed = K3Format().parse_full(reply, thinking=True)
    if not parsed.tool_calls:
        return False, False
    call = parsed.tool_calls[0]
    if call.name != conv.tool:
        return False, False
    schema = next(t["function"]["parameters"] for t in conv.tools or [] if t["function"]["name"] == call.name)
    props, required = schema["properties"], schema.get("required", [])
    try:
        args = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        return False, True
    if not isinstance(args, dict) or not set(required) <= set(args) or not set(args) <= set(props):
        return False, True
    for key, value in args.items():
        kind = props[key]["type"]
        if isinstance(value, bool) and kind != "boolean" or not isinstance(value, _TYPES[kind]):
            return False, True
    return True, True


def header_rate(model: KimiForCausalLM, tokenizer, headers: list[str], max_new: int = 128) -> tuple[float, list[str]]:
    """Share of greedy completions of ``headers`` that parse (see :func:`completion_parses`), and the completions."""
    stop = {tokenizer.token_id("[EOS]"), tokenizer.token_id("<|end_of_msg|>")}
    results = greedy_generate(model, [tokenizer.encode(h) for h in headers], max_new, stop)
    texts = [tokenizer.decode(ids) for ids, _ in results]
    ok = [completion_parses(h, t, ended) for h, t, (_, ended) in zip(headers, texts, results)]
    return sum(ok) / max(1, len(ok)), texts


def tool_rates(model: KimiForCausalLM, tokenizer, n: int, max_new: int = 160) -> tuple[float, float, list[str]]:
    """(valid right-tool call share, right-tool share, replies) over ``n`` held-out tool prompts."""
    convs = heldout_tool_prompts(random.Random(TOOL_PROMPT_SEED), n)
    prompts = [c.render(add_generation_prompt=True).token_ids(tokenizer) for c in convs]
    stop = {tokenizer.token_id("<|end_of_msg|>")}
    replies = [tokenizer.decode(ids) for ids, _ in greedy_generate(model, prompts, max_new, stop)]
    checks = [tool_call_check(r, c) for r, c in zip(replies, convs)]
    return sum(v for v, _ in checks) / n, sum(r for _, r in checks) / n, replies


# ---- the issue-21 targets, through the engine (what /v1/completions and /v1/chat/completions run) ----

README_CHAT = "Write a Python function that reverses a list."
POOL_PROMPT_SEED = 2121  # the 40 held-out two-/three-tool prompts


def engine_complete(llm, prompts: list, max_tokens: int, token_healing: bool = False,
                    grammars: list[str | None] | None = None,
                    choice_points: list[tuple] | None = None) -> list[tuple[str, bool]]:
    """Greedy completions (text with special markers, whether a stop token ended it) of text
    prompts or ``{"prompt_token_ids": ...}`` dicts, through :class:`tidal.LLM`'s engine; with
    ``grammars``, each held to its llguidance grammar (what the server adds to a chat request),
    with ``choice_points`` (one tuple per grammar) where it picks a name whole."""
    from tidal.sampling_params import SamplingParams, StructuredOutputsParams

    def params(grammar: str | None, points: tuple = ()) -> SamplingParams:
        so = StructuredOutputsParams(llguidance=grammar, choice_points=points) if grammar else None
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, token_healing=token_healing,
                              skip_special_tokens=False, structured_outputs=so)

    if grammars is not None:
        sps = [params(g, p) for g, p in zip(grammars, choice_points or [()] * len(grammars))]
    else:
        sps = params(None)
    return [(o.outputs[0].text, o.outputs[0].finish_reason == "stop") for o in llm.generate(prompts, sps)]


def body_parses(prompt: str, completion: str, ended: bool) -> bool:
    """Whether a bare one-line signature ``prompt`` (with or without its trailing newline) plus the
    completion is a function with at least one statement besides ``pass`` (a lone docstring does
    not count). The function runs until the first non-blank line back at column 0; a completion cut
    by the token limit loses its last, possibly partial, line."""
    lines = (prompt + completion).split("\n")
    kept, finished = [lines[0]], ended
    for line in lines[1:]:
        if line.strip() and not line[0].isspace():
            finished = True
            break
        kept.append(line)
    if not finished and len(kept) > 1:
        kept.pop()
    try:
        tree = ast.parse("\n".join(kept))
    except SyntaxError:
        return False
    if not tree.body or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    return any(not isinstance(st, ast.Pass) and not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))
               for st in tree.body[0].body)


def signature_rates(llm, signatures: list[str], max_tokens: int = 96) -> dict[str, float | list[str]]:
    """Parse rates of greedy completions of bare signatures: without the trailing newline, with it
    (raw tokens), and with it token-healed (the server's default for /v1/completions)."""
    out: dict[str, float | list[str]] = {}
    for key, suffix, heal in (("no_newline", "", False), ("newline", "\n", False), ("newline_healed", "\n", True)):
        prompts = [s + suffix for s in signatures]
        res = engine_complete(llm, prompts, max_tokens, heal)
        ok = [body_parses(p, t.split("<|end_of_msg|>")[0].split("[EOS]")[0], e) for p, (t, e) in zip(prompts, res)]
        out[key] = sum(ok) / len(ok)
        out[key + "_texts"] = [p + t for p, (t, _) in zip(prompts, res)]
    return out


def chat_replies(llm, convs: list[Conversation], max_tokens: int, served: bool = False,
                 whole_names: bool = False) -> list[str]:
    """Greedy replies to ``convs``; with ``served``, each held to the reply grammar the server puts
    on a chat request with these tools (tool_choice auto: only declared tools, schema-valid
    arguments), the tool name picked by the token mask (the server's default) or, with
    ``whole_names``, scored whole (``tidal serve --tool-name-choice whole``)."""
    from tidal.serve.chat import K3Format

    tok = llm.tokenizer
    fmt = K3Format()
    rendered = [c.render(add_generation_prompt=True) for c in convs]
    prompts = [{"prompt_token_ids": r.token_ids(tok)} for r in rendered]
    grammars = points = None
    if served:
        grammars = [fmt.reply_grammar(r, tools=c.tools, tool_choice="auto") for r, c in zip(rendered, convs)]
        points = [fmt.reply_choice_points(tools=c.tools, tool_choice="auto") if whole_names else () for c in convs]
    return [t for t, _ in engine_complete(llm, prompts, max_tokens, grammars=grammars, choice_points=points)]


def pool_tool_rates(llm, n: int = 40, max_tokens: int = 160, served: bool = False,
                    whole_names: bool = False) -> tuple[float, float, list[str]]:
    """(valid right-tool call share, right-tool share, replies) over the held-out pool prompts: the
    model's own replies, or with ``served`` the replies /v1/chat/completions gives (reply grammar;
    the tool name by the token mask, or scored whole with ``whole_names``)."""
    from tidal.train.conversations import heldout_pool_prompts

    convs = heldout_pool_prompts(random.Random(POOL_PROMPT_SEED), n)
    replies = chat_replies(llm, convs, max_tokens, served, whole_names)
    checks = [tool_call_check(r, c) for r, c in zip(replies, convs)]
    return sum(v for v, _ in checks) / n, sum(r for _, r in checks) / n, replies


def fenced_python(text: str) -> str | None:
    """The first closed ```python (or bare ```) block of ``text``, or None."""
    start = text.find("```")
    if start < 0:
        return None
    body_start = text.find("\n", start)
    end = text.find("```", body_start + 1) if body_start >= 0 else -1
    if end < 0:
        return None
    return text[body_start + 1 : end]


def readme_chat(llm, effort: str, max_tokens: int = 64) -> tuple[bool, str]:
    """Whether the README's chat example, at ``effort``, answers within ``max_tokens`` with a closed
    fenced code block that parses (in the response channel); and the reply."""
    from tidal.serve.chat import K3Format

    conv = Conversation([{"role": "user", "content": README_CHAT}], effort=effort)
    reply = chat_replies(llm, [conv], max_tokens)[0]
    content = K3Format().parse_full(reply, thinking=effort != "off").content or ""
    code = fenced_python(content)
    if code is None or not code.strip():
        return False, reply
    try:
        ast.parse(code)
    except SyntaxError:
        return False, reply
    return True, reply


# Chats that declare no tools: (messages, effort, seeds). A reply to one that calls a tool calls a tool
# nobody declared; the server holds such replies to the K3 skeleton (no tools element).
NO_TOOL_CHATS = (
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to three."}], "off", 32),
    *(([{"role": "user", "content": r}], "off", 16) for r in ("Count to three.", "What is 2 + 2?", "Say hello.",
                                                             "Name a colour.", README_CHAT)),
)


def undeclared_call_counts(llm, served: bool = False, max_tokens: int = 64) -> list[tuple[str, int, int]]:
    """(request, replies that call a tool, replies) for each of NO_TOOL_CHATS, sampled at
    temperature 1 with seeds 0..n-1; the replies as the model writes them, or with ``served`` held
    to the grammar the server puts on a chat reply with no tools declared
    (``K3Format.reply_grammar(prompt, skeleton=True)``). A reply calls a tool when it opens a
    tools section (a call cut short by max_tokens is dropped by the parser, but the reply is as
    wrong: its answer is missing)."""
    from tidal.sampling_params import SamplingParams, StructuredOutputsParams
    from tidal.serve.chat import K3Format
    from tidal.serve.chat.xtml import OPEN, SEP

    fmt, tok = K3Format(), llm.tokenizer
    out = []
    for messages, effort, n in NO_TOOL_CHATS:
        prompt = fmt.render(messages, thinking=effort)
        spec = StructuredOutputsParams(llguidance=fmt.reply_grammar(prompt, skeleton=True)) if served else None
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, skip_special_tokens=False,
                                 stop_token_ids=fmt.stop_token_ids(tok), structured_outputs=spec) for s in range(n)]
        outs = llm.generate([{"prompt_token_ids": prompt.token_ids(tok)}] * n, params)
        calls = sum(f"{OPEN}tools{SEP}" in o.outputs[0].text for o in outs)
        out.append((messages[-1]["content"] + (" (terse system)" if len(messages) > 1 else ""), calls, n))
    return out
