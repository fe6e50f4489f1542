"""Training data for the embedded model: the assistant-only loss mask, the tool pool, function
snippets (both spellings of the signature boundary), determinism per seed, held-out sets disjoint
from training, and the issue-21 metrics' checkers."""

from __future__ import annotations

import random
import re

import pytest
import torch

from tidal import presets
from tidal.embedded import embedded_model_dir
from tidal.model.context import SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.tokenizer import load_tokenizer
from tidal.train.code_tasks import CODE_TASKS, HELDOUT_SIGNATURES
from tidal.train.conversations import copy_drill, heldout_pool_prompts, pool_dialogue, training_conversations
from tidal.train.data import (
    Corpus, FunctionSnippet, assistant_header, assistant_mask, build_corpus, copy_row, encode_snippet,
    function_snippets, load_sources, sample_batch,
)
from tidal.train.evaluate import README_CHAT, body_parses, fenced_python, tool_call_check
from tidal.train.tool_pool import HELDOUT_OBJECTS, TRAIN_OBJECTS, pool_tools
from tidal.train.trainer import lm_loss


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(embedded_model_dir())


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_mask_covers_exactly_the_assistant_turns(tok):
    """Masked tokens are the assistant messages' bodies through their end-of-message token: no
    system prompt, tool declaration, user turn or tool result."""
    rng = random.Random(0)
    for _ in range(30):
        conv = pool_dialogue(rng)
        ids = conv.render().token_ids(tok)
        mask = assistant_mask(ids, assistant_header(tok), tok.special_tokens["<|end_of_msg|>"])
        text = conv.render().text
        head = '<|open|>message role="assistant"<|sep|>'
        want = [part.split("<|end_of_msg|>")[0] + "<|end_of_msg|>" for part in text.split(head)[1:]]
        assert [tok.decode(r) for r in _runs(ids, mask)] == want
        masked = "".join(want)
        assert "# Tools" not in masked and conv.messages[0]["content"] not in masked
        assert conv.messages[2]["content"] not in masked  # the tool's result


def test_corpus_chat_mask_lines_up_with_the_stream(tok):
    sources = load_sources()
    sources.train = dict(sorted(sources.train.items())[:2])
    convs = training_conversations(random.Random(1), 12, [])
    chats = [c.render() for c in convs]
    corpus = build_corpus(tok, sources, chats, tok.token_id("[EOS]"),
                          function_snippets(sources.train, random.Random(0)), seed=0)
    assert corpus.chat_mask.shape == corpus.chat.shape
    first = chats[0].token_ids(tok)
    header, end = assistant_header(tok), tok.special_tokens["<|end_of_msg|>"]
    assert corpus.chat_mask[: len(first)].tolist() == assistant_mask(first, header, end)
    windows, mask = sample_batch(corpus, 0, 3, 32, 512, chat_fraction=0.5, body_fraction=0.3)
    chat_rows = [i for i in range(32) if not bool(mask[i].all())]
    assert chat_rows and all(0 < int(mask[i].sum()) < 513 for i in chat_rows)  # each holds an assistant turn
    starts = set(corpus.chat_starts.tolist())
    for i in chat_rows:
        at = next(s for s in starts if torch.equal(corpus.chat[s : s + 513].long(), windows[i]))
        assert torch.equal(mask[i], corpus.chat_mask[at : at + 513].bool())
    bodies = corpus.body.long().unfold(0, 513, 1)[corpus.body_starts[corpus.body_starts < len(corpus.body) - 512]]
    code = corpus.code.long().unfold(0, 513, 1)
    plain = [windows[i] for i in range(32) if i not in chat_rows]
    at_body = [bool((bodies == w).all(1).any()) for w in plain]
    assert any(at_body) and all(b or bool((code == w).all(1).any()) for b, w in zip(at_body, plain))


def test_masked_loss_is_the_mean_over_marked_tokens():
    cfg = presets.tiny_k3(hidden_size=32, num_layers=2, vocab_size=64)
    model = init_weights(KimiForCausalLM(cfg), seed=0).to_dtype(torch.float32)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 64, (2, 17), generator=g)
    mask = torch.rand(2, 17, generator=g) < 0.5
    mask[0, 1] = True
    with torch.no_grad():
        got = float(lm_loss(model, windows, mask))
        cache = SimpleCache(cfg, 2, torch.float32)
        logits = model.compute_logits(model(windows[:, :-1].reshape(-1), simple_batch(cfg, [16, 16], cache, [0, 0])))
        per = torch.nn.functional.cross_entropy(logits.double(), windows[:, 1:].reshape(-1), reduction="none")
        keep = mask[:, 1:].reshape(-1)
    assert got == pytest.approx(float(per[keep].mean()), rel=1e-5)
    assert got != pytest.approx(float(per.mean()), rel=1e-3)


def test_snippets_spell_the_signature_boundary_both_ways(tok):
    snip = FunctionSnippet("def f(x):", "    return x + 1\n")
    whole, split = encode_snippet(tok, snip, False), encode_snippet(tok, snip, True)
    assert tok.decode(whole) == tok.decode(split) == snip.text
    assert whole != split  # the split spelling ends a token at "\n"
    assert tok.decode(split[: len(tok.encode("def f(x):\n"))]) == "def f(x):\n"


def test_snippets_are_functions_and_some_lose_their_docstring():
    sources = {k: v for k, v in load_sources().train.items() if k in ("json.decoder", "string", "tokenize")}
    snips = function_snippets(sources, random.Random(0))
    assert len(snips) > 20 and snips == function_snippets(sources, random.Random(0))
    for s in snips[:50]:
        assert s.header.lstrip().startswith(("def ", "async def ")) and s.header.endswith(":")
    assert any('"""' not in s.text for s in snips) and any('"""' in s.text for s in snips)


def test_generators_are_deterministic_per_seed():
    a = [c.render().text for c in training_conversations(random.Random(7), 40, [])]
    b = [c.render().text for c in training_conversations(random.Random(7), 40, [])]
    c = [c.render().text for c in training_conversations(random.Random(8), 40, [])]
    assert a == b and a != c
    p = [x.render().text for x in heldout_pool_prompts(random.Random(3), 10)]
    assert p == [x.render().text for x in heldout_pool_prompts(random.Random(3), 10)]


def test_heldout_tool_prompts_are_disjoint_from_training():
    """Held-out prompts declare 2-3 tools none of which training declares, with values training
    never uses; the right tool is always among them and the training pool has hundreds."""
    train_names = {t.name for t in pool_tools()}
    assert len(train_names) >= 400 and not train_names & {t.name for t in pool_tools(heldout=True)}
    assert not {o[0] for o in TRAIN_OBJECTS} & {o[0] for o in HELDOUT_OBJECTS}
    train_text = " ".join(c.render().text for c in training_conversations(random.Random(0), 400, []))
    prompts = heldout_pool_prompts(random.Random(0), 40)
    for conv in prompts:
        names = [t["function"]["name"] for t in conv.tools]
        assert 2 <= len(names) <= 3 and conv.tool in names and not set(names) & train_names
        assert f'"{conv.tool}"' not in train_text
    for value in ("autumn fair", "nadia", "warranty", "escalated"):
        assert value not in train_text


def test_heldout_signatures_are_disjoint_from_training():
    names = [re.match(r"def (\w+)\(", s).group(1) for s in HELDOUT_SIGNATURES]
    assert len(set(names)) == len(names) == 40 and all(s.endswith(":") and "\n" not in s for s in HELDOUT_SIGNATURES)
    assert not set(names) & {t.name for t in CODE_TASKS}
    train = "\n".join(load_sources().train.values())
    assert not [n for n in names if re.search(rf"def {n}\(", train)]
    assert not any(t.what in README_CHAT for t in CODE_TASKS)  # the README's example is not a training task


def test_pool_dialogues_round_trip_and_the_checker_rejects_bad_calls():
    rng = random.Random(5)
    for _ in range(40):
        conv = pool_dialogue(rng)
        if conv.effort == "off":
            continue
        text = conv.render().text
        reply = text.split('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>', 1)[1].split("<|end_of_msg|>")[0]
        assert tool_call_check(reply, conv) == (True, True)
        other = next(t["function"]["name"] for t in conv.tools if t["function"]["name"] != conv.tool)
        assert tool_call_check(reply.replace(f'tool="{conv.tool}"', f'tool="{other}"'), conv) == (False, False)
        assert tool_call_check(reply.replace('key="', 'key="zz_', 1), conv) == (False, True)


def test_body_parses():
    assert body_parses("def f(x):", "\n    y = x + 1\n    return y\n\ndef g():", ended=False)
    assert body_parses("def f(x):\n", "    return x\n", ended=True)
    assert body_parses("def f(x):\n", "    return x\n    y = (1,", ended=False)  # cut line dropped
    assert not body_parses("def f(x):\n", "    pass\n", ended=True)
    assert not body_parses("def f(x):\n", '    """Doc."""\n', ended=True)
    assert not body_parses("def f(x):\n", "def g(y):\n    return y\n", ended=True)  # a new def, no body
    assert not body_parses("def f(x):", "\n    return x +\n\nclass A:", ended=False)


def test_fenced_python():
    assert fenced_python("Here:\n```python\nx = 1\n```\nok") == "x = 1\n"
    assert fenced_python("```python\nx = 1\n") is None and fenced_python("no code") is None


def test_copy_rows_write_each_span_twice_and_target_only_the_second_writing():
    code = torch.arange(10_000, dtype=torch.int32)  # distinct ids: a copy is recognisable
    row, mask = copy_row(code, 513, random.Random(3))
    assert row.shape == mask.shape == (513,) and torch.equal(row, copy_row(code, 513, random.Random(3))[0])
    ids, m = row.tolist(), mask.tolist()
    runs, i = [], 0
    while i < len(m):  # maximal runs of targets: the second writing of a span, less its first token
        if m[i]:
            j = i
            while j < len(m) and m[j]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    assert len(runs) >= 4 and 0.35 < sum(m) / len(m) < 0.5
    for start, end in runs:
        k = end - start + 1
        copy = start - 1
        if end < len(m):  # the last span may be cut by the window
            assert ids[copy : copy + k] == ids[copy - k : copy]
            assert ids[copy - k + 1 : copy] == list(range(ids[copy - k] + 1, ids[copy - k] + k))  # a real span
    assert not any(m[: runs[0][0]])
    row1, first = copy_row(code, 513, random.Random(3), first=True)  # the same window, the first writings marked
    assert torch.equal(row1, row) and not bool((first.bool() & mask.bool()).any())
    for start, end in runs[:-1]:
        k = end - start + 1
        assert first[start - k : start - 1].all() and not first[start - 1 - k]


def test_copy_rows_enter_batches_only_when_asked(tok):
    sources = load_sources()
    sources.train = dict(sorted(sources.train.items())[:2])
    corpus = build_corpus(tok, sources, [c.render() for c in training_conversations(random.Random(1), 12, [])],
                          tok.token_id("[EOS]"))
    plain, plain_mask = sample_batch(corpus, 0, 5, 16, 512, chat_fraction=0.0)
    assert bool(plain_mask.all())
    windows, mask = sample_batch(corpus, 0, 5, 16, 512, chat_fraction=0.0, copy_fraction=1.0)
    assert all(0.25 < float(m.float().mean()) < 0.55 for m in mask)
    assert torch.equal(windows, sample_batch(corpus, 0, 5, 16, 512, chat_fraction=0.0, copy_fraction=1.0)[0])


def test_copy_drills_answer_with_the_requested_items():
    rng = random.Random(2)
    for _ in range(20):
        conv = copy_drill(rng)
        request, reply = conv.messages[0]["content"], conv.messages[1]["content"]
        assert reply and reply in request and request.endswith(reply)


def test_multi_turn_pool_dialogues_call_each_turns_tool():
    """Every assistant call turn of a multi-request dialogue is a valid call of a declared tool, the
    one its own request names (its thought ends with that name)."""
    rng = random.Random(9)
    seen = 0
    for _ in range(30):
        conv = pool_dialogue(rng, turns=3)
        if conv.effort == "off":
            continue
        names = [t["function"]["name"] for t in conv.tools]
        calls = [m for m in conv.messages if m.get("tool_calls")]
        assert len(calls) == 3 and len([m for m in conv.messages if m["role"] == "user"]) == 3
        head = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
        replies = [p.split("<|end_of_msg|>")[0] for p in conv.render().text.split(head)[1:]][::2]
        for msg, reply in zip(calls, replies):
            name = msg["tool_calls"][0]["function"]["name"]
            assert name in names and msg["reasoning_content"].endswith(f": {name}.")
            one = type(conv)(conv.messages[:1], conv.tools, conv.effort, name)
            assert tool_call_check(reply, one) == (True, True)
            seen += 1
    assert seen > 30
    assert len(TRAIN_OBJECTS) >= 150 and len(pool_tools()) >= 1500


def test_served_pool_replies_hold_to_the_reply_grammar():
    """The eval's served mode adds the grammar the server puts on a chat request with tools: the
    embedded model's replies then call only declared tools with schema-valid arguments, where its
    own replies call tools it saw in training (so the mode is not a no-op)."""
    import json

    import jsonschema

    from tidal import LLM
    from tidal.serve.chat import K3Format
    from tidal.train.evaluate import POOL_PROMPT_SEED, chat_replies

    llm = LLM(str(embedded_model_dir()), kv_cache_memory_bytes=1 << 24)
    convs = heldout_pool_prompts(random.Random(POOL_PROMPT_SEED), 2)
    own = chat_replies(llm, convs, 96)
    served = chat_replies(llm, convs, 96, served=True)
    declared_calls = 0
    for conv, reply in zip(convs, served):
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in conv.tools}
        for call in K3Format().parse_full(reply, thinking=True).tool_calls:
            assert call.name in tools
            jsonschema.validate(json.loads(call.arguments or "{}"), tools[call.name])
            declared_calls += 1
    assert declared_calls >= 1
    undeclared = [c.name for conv, r in zip(convs, own) for c in K3Format().parse_full(r, thinking=True).tool_calls
                  if c.name not in {t["function"]["name"] for t in conv.tools}]
    assert undeclared
