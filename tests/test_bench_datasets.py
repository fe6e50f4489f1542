"""tidal bench workloads: exact token lengths, both range-ratio semantics, seed reproducibility,
Mooncake shared prefixes, multi-turn prefix growth with the server's replies fed back."""

import base64
import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tidal.bench import text
from tidal.bench.datasets import (
    load_mooncake,
    random_lengths,
    random_requests,
    trace_requests,
)
from tidal.bench.metrics import request_metrics
from tidal.bench.multiturn import AgentConfig, AgentWorkload, measure_chars_per_token
from tidal.bench.records import Chunk, RequestRecord
from tidal.bench.tokenizer import HFTokenizer, TiktokenTokenizer, load_local_tokenizer


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE with real merges: decode -> encode changes token counts, as in production."""
    rng = np.random.default_rng(123)
    corpus = [text.code(rng, 40) for _ in range(30)] + [text.words(rng, 300) for _ in range(30)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=700, special_tokens=["<|eos|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path)


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    """One token per byte (no merges)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    path = tmp_path_factory.mktemp("byte") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path)


@pytest.fixture(scope="module")
def tiktoken_dir(bpe, tmp_path_factory):
    """The BPE above as a Kimi-style tiktoken.model (base64 bytes + rank per line)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    byte_of = {chr(c): b for b, c in zip(printable + rest, printable + [256 + i for i in range(len(rest))])}
    vocab = json.loads(Path(bpe.name).read_text())["model"]["vocab"]
    lines = []
    for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        if all(ch in byte_of for ch in tok):
            lines.append(f"{base64.b64encode(bytes(byte_of[ch] for ch in tok)).decode()} {len(lines)}")
    d = tmp_path_factory.mktemp("kimi")
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    return d


def test_tiktoken_model_tokenizer(tiktoken_dir):
    tok = load_local_tokenizer(tiktoken_dir)
    assert isinstance(tok, TiktokenTokenizer)
    s = "def load_cache(self, path):\n    return 中文 42"
    assert tok.decode(tok.encode(s)) == s
    for r in random_requests(4, 150, 4, tokenizer=tok, range_ratio=0.5, seed=4):
        assert len(tok.encode(r.prompt)) == r.input_len
    pieces = ["def lo", "ad_cache(se", "lf)"]
    counts = tok.chunk_token_counts(pieces)
    assert sum(counts) == len(tok.encode("".join(pieces))) and counts[0] >= 1


def test_allowed_ids_exclude_specials_and_round_trip(bpe):
    ids = bpe.allowed_ids()
    special = {bpe._tok.token_to_id("<|eos|>"), bpe._tok.token_to_id("<|im_end|>")}
    assert len(ids) > 300 and not special & set(ids.tolist())
    for i in ids[::37]:
        assert bpe.encode(bpe.decode([int(i)])) == [int(i)]


@pytest.mark.parametrize("ratio,semantics", [(None, "sglang"), (0.5, "sglang"), (0.3, "vllm")])
def test_text_prompts_have_exact_token_lengths(bpe, ratio, semantics):
    reqs = random_requests(12, 200, 16, tokenizer=bpe, range_ratio=ratio, semantics=semantics, seed=3, salt=1)
    lens = random_lengths(np.random.default_rng(3), 12, 200, ratio, semantics)
    assert [r.input_len for r in reqs] == lens.tolist()
    for r in reqs:
        assert isinstance(r.prompt, str) and len(bpe.encode(r.prompt)) == r.input_len
    if ratio is not None:
        assert len(set(lens.tolist())) > 1


def test_token_id_prompts_have_exact_lengths(bpe):
    reqs = random_requests(5, 333, 8, tokenizer=bpe, fmt="ids", seed=0)
    allowed = set(bpe.allowed_ids().tolist())
    for r in reqs:
        assert len(r.prompt) == r.input_len == 333 and set(r.prompt) <= allowed
    assert all(r.output_len == 8 for r in reqs)


def test_range_ratio_semantics():
    rng = np.random.default_rng(0)
    sg = random_lengths(rng, 4000, 100, 0.25, "sglang")   # [25, 100]
    assert sg.min() == 25 and sg.max() == 100
    vl = random_lengths(rng, 4000, 100, 0.25, "vllm")     # [75, 125]
    assert vl.min() == 75 and vl.max() == 125
    assert random_lengths(rng, 50, 10, 0.0, "sglang").min() >= 1        # SGLang's default r=0: [1, L]
    assert set(random_lengths(rng, 20, 64, 1.0, "sglang").tolist()) == {64}
    assert set(random_lengths(rng, 20, 64, 0.0, "vllm").tolist()) == {64}
    with pytest.raises(ValueError):
        random_lengths(rng, 3, 10, 1.0, "vllm")
    with pytest.raises(ValueError):
        random_lengths(rng, 3, 10, 1.5, "sglang")


def test_seed_reproducibility_and_row_salts(bpe):
    a = random_requests(4, 64, 32, tokenizer=bpe, range_ratio=0.5, seed=7, salt=1)
    b = random_requests(4, 64, 32, tokenizer=bpe, range_ratio=0.5, seed=7, salt=1)
    assert [(r.prompt, r.output_len) for r in a] == [(r.prompt, r.output_len) for r in b]
    other_row = random_requests(4, 64, 32, tokenizer=bpe, range_ratio=0.5, seed=7, salt=2)
    assert [r.input_len for r in other_row] == [r.input_len for r in a]       # same lengths,
    assert all(x.prompt != y.prompt for x, y in zip(a, other_row))            # new contents (no cross-row cache hits)
    other_seed = random_requests(4, 64, 32, tokenizer=bpe, range_ratio=0.5, seed=8, salt=1)
    assert [r.prompt for r in other_seed] != [r.prompt for r in a]


def test_mooncake_trace_shares_prefix_blocks(bpe, tmp_path):
    lines = [{"timestamp": 1000, "input_length": 90, "output_length": 5, "hash_ids": [1, 2, 3]},
             {"timestamp": 1500, "input_length": 70, "output_length": 7, "hash_ids": [1, 2, 4]},
             {"timestamp": 4000, "input_length": 40, "output_length": 3, "hash_ids": [9, 2]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    entries = load_mooncake(path)
    assert [e.hash_ids for e in entries] == [[1, 2, 3], [1, 2, 4], [9, 2]]
    ids = trace_requests(entries, tokenizer=bpe, block_size=32, fmt="ids", seed=1, salt=1)
    assert [len(r.prompt) for r in ids] == [90, 70, 40] and [r.output_len for r in ids] == [5, 7, 3]
    assert [r.arrival for r in ids] == pytest.approx([0.0, 0.5, 3.0])
    assert ids[0].prompt[:64] == ids[1].prompt[:64] and ids[0].prompt[64:70] != ids[1].prompt[64:70]
    assert ids[2].prompt[:32] != ids[0].prompt[:32] and ids[2].prompt[32:40] == ids[0].prompt[32:40]
    assert trace_requests(entries, tokenizer=bpe, block_size=32, fmt="ids", seed=1, salt=2)[0].prompt != ids[0].prompt
    txt = trace_requests(entries, tokenizer=bpe, block_size=32, fmt="text", seed=1, salt=1)
    assert [len(bpe.encode(r.prompt)) for r in txt] == [90, 70, 40]
    common = len(os.path.commonprefix([txt[0].prompt, txt[1].prompt]))
    assert len(bpe.encode(txt[0].prompt[:common])) >= 56        # the shared 64 tokens, give or take a boundary


def test_chunk_token_counts_follow_characters_to_tokens(byte_tok):
    # byte tokens: "é" is two bytes, so two tokens land in the second piece.
    assert byte_tok.chunk_token_counts(["h", "é", "llo"]) == [1, 2, 3]
    r = RequestRecord(chunks=[Chunk(0.1, "h"), Chunk(0.2, "é"), Chunk(0.5, "llo")], end=0.6)
    m = request_metrics(r, counter=byte_tok.chunk_token_counts, itl_rule="token")
    assert m.output_tokens == 6 and m.itl == pytest.approx([0.05, 0.05, 0.1, 0.1, 0.1])


def reply(content, prompt_tokens, completion_tokens=20, tool_calls=None):
    return RequestRecord(chunks=[Chunk(0.1, content)], end=0.2, prompt_tokens=prompt_tokens,
                         completion_tokens=completion_tokens, tool_calls=tool_calls or [])


def test_multiturn_history_grows_with_real_replies(bpe):
    cfg = AgentConfig(system_len=300, tool_result_len=120, output_len=40, turns=(3, 6), max_context=10**6,
                      chars_per_token=measure_chars_per_token(bpe))
    assert 1.5 < cfg.chars_per_token < 8
    w = AgentWorkload(cfg, seed=5, salt=1)
    assert 0.5 < len(bpe.encode(w.system_prompt)) / 300 < 1.5
    s1, s2 = w.new_session(), w.new_session()
    assert s1.messages[0] is not s2.messages[0] and s1.messages[0] == s2.messages[0]   # one shared system prompt
    assert s1.messages[1] != s2.messages[1]                                            # unique tasks
    prev, turns = None, 0
    while not s1.done:
        req = s1.next_request()
        assert req.tools == w.tools and 1 <= req.output_len <= 8 * cfg.output_len
        if prev is not None:
            n = len(prev.messages)
            assert req.messages[:n] == prev.messages                                   # a strict prefix extension
            assert req.messages[n] == {"role": "assistant", "content": f"reply {turns - 1}"}
            assert req.messages[n + 1]["role"] == "user" and len(req.messages) == n + 2
        s1.add_reply(reply(f"reply {turns}", 1000 * (turns + 1)))
        prev, turns = req, turns + 1
    assert 3 <= turns <= 6 and turns == s1.n_turns
    again = AgentWorkload(cfg, seed=5, salt=1).new_session()
    assert again.messages == AgentWorkload(cfg, seed=5, salt=1).new_session().messages


def test_multiturn_tool_results_have_realistic_sizes(bpe):
    cfg = AgentConfig(system_len=100, tool_result_len=120, output_len=40, turns=(200, 200), max_context=10**9,
                      chars_per_token=measure_chars_per_token(bpe))
    s = AgentWorkload(cfg, seed=2).new_session()
    sizes = []
    while not s.done:
        s.next_request()
        s.add_reply(reply("ok", 10))
        if not s.done:
            sizes.append(len(bpe.encode(s.messages[-1]["content"])))
    assert len(sizes) == 199
    median, p90 = np.median(sizes), np.percentile(sizes, 90)
    assert 0.5 * 120 < median < 1.5 * 120 and p90 > 2.5 * median and min(sizes) < 0.3 * median  # log-normal spread


def test_multiturn_tool_calls_and_context_limit(bpe):
    cfg = AgentConfig(system_len=200, tool_result_len=100, output_len=30, turns=(20, 20), max_context=3000,
                      chars_per_token=measure_chars_per_token(bpe))
    s = AgentWorkload(cfg, seed=1).new_session()
    s.next_request()
    calls = [{"id": "call_a", "type": "function", "function": {"name": "grep", "arguments": "{}"}},
             {"id": "call_b", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]
    s.add_reply(reply("", 900, tool_calls=calls))
    assert s.messages[-3]["tool_calls"] == calls
    assert [(m["role"], m["tool_call_id"]) for m in s.messages[-2:]] == [("tool", "call_a"), ("tool", "call_b")]
    while not s.done:
        n = len(s.messages)
        s.next_request()
        s.add_reply(reply("ok", 900 + 400 * s.turn))
        assert len(s.messages) == n + 2 or s.done
    assert s.turn < 20                      # ended by the context limit, not the turn count
