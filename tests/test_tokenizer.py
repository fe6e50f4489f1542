"""Tokenizers (Kimi tiktoken format and HF tokenizer.json) and the incremental detokenizer."""

import json
import random

import pytest
import regex

from tidal.embedded import write_byte_tokenizer
from tidal.serve.chat import K3Format
from tidal.detokenizer import Detokenizer
from tidal.tokenizer import (
    KIMI_PAT_STR,
    HFTokenizer,
    TiktokenTokenizer,
    load_tiktoken_ranks,
    load_tokenizer,
    save_tiktoken_ranks,
    split_long_runs,
)

MERGES = [b"he", b"ll", b"hell", b"hello", b"12", b"123", b"1234", b"o ", b"o w",
          "中".encode()[:2], "中".encode(), "文".encode()[:2], "文".encode(), "中文".encode(), "文a".encode()]
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
            6: "<|im_end|>", 7: "<|im_user|>"}


def make_tiktoken_dir(path):
    ranks = {bytes([b]): b for b in range(256)}
    for m in MERGES:
        ranks[m] = len(ranks)
    save_tiktoken_ranks(path / "tiktoken.model", ranks)
    n = len(ranks)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|end_of_msg|>", "bos_token": "[BOS]",
        "added_tokens_decoder": {str(n + k): {"content": v, "special": True} for k, v in SPECIALS.items()},
    }))
    return ranks


@pytest.fixture(scope="module")
def tik(tmp_path_factory):
    d = tmp_path_factory.mktemp("tik")
    make_tiktoken_dir(d)
    return load_tokenizer(d)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    write_byte_tokenizer(d)
    return load_tokenizer(d)


def test_tiktoken_model_file_round_trip(tmp_path):
    ranks = make_tiktoken_dir(tmp_path)
    assert load_tiktoken_ranks(tmp_path / "tiktoken.model") == ranks
    line = (tmp_path / "tiktoken.model").read_text().splitlines()[256]
    assert line == "aGU= 256"  # base64("he") and its rank


def test_tiktoken_specials_and_reserved_slots(tik):
    assert isinstance(tik, TiktokenTokenizer)
    n = 256 + len(MERGES)
    assert tik.vocab_size == n + 256
    assert tik.special_tokens["<|open|>"] == n + 3
    assert tik.special_tokens[f"<|reserved_token_{n + 8}|>"] == n + 8
    assert len(tik.special_tokens) == 256
    assert tik.eos_token_id == n + 2 and tik.bos_token_id == n


def test_tiktoken_bpe_merges_within_pretokenized_pieces(tik):
    ranks = tik.ranks
    assert tik.encode("hello") == [ranks[b"hello"]]
    # "o w" is a rank, but "hello" and " world" are separate pieces: no merge across them.
    ids = tik.encode("hello world")
    assert ids[0] == ranks[b"hello"] and ranks[b"o w"] not in ids and ranks[b"o "] not in ids
    assert tik.encode("12345") == [ranks[b"123"], ord("4"), ord("5")]  # digits in groups of 1-3
    assert tik.encode("中文a") == [ranks["中文".encode()], ord("a")]  # Han runs stand alone


def test_tiktoken_split_matches_the_regex_module(tik):
    """tiktoken's pieces are the pattern's matches: encoding each `regex` match alone gives the
    same ids (merges exist that would cross piece boundaries)."""
    texts = ["hello world, 12345 don't\n\n  x!!\n", "中文abc Hello文a  \t\nWORLDs's", "o wo w o  w123中文"]
    for text in texts:
        pieces = regex.findall(KIMI_PAT_STR, text, flags=regex.V1)
        assert "".join(pieces) == text
        assert tik.encode(text) == [i for p in pieces for i in tik.encode(p)]


@pytest.mark.parametrize("name", ["tik", "hf"])
def test_round_trip_and_user_text_stays_plain(name, request):
    tok = request.getfixturevalue(name)
    rng = random.Random(0)
    alphabet = "ab c\n中文é🙂<|>[]ohel123"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(30)))
        assert tok.decode(tok.encode(text)) == text
    typed = "say <|open|> and [EOS] please"
    ids = tok.encode(typed)
    assert not set(ids) & set(tok.special_tokens.values())
    assert tok.decode(ids) == typed
    marked = tok.encode("a<|open|>b", allow_special=True)
    assert tok.special_tokens["<|open|>"] in marked
    assert tok.decode(marked) == "a<|open|>b"
    assert tok.decode(marked, skip_special_tokens=True) == "ab"


@pytest.mark.parametrize("name", ["tik", "hf"])
def test_rendered_prompt_markers_encode_to_their_ids(name, request):
    tok = request.getfixturevalue(name)
    prompt = K3Format().render([{"role": "user", "content": "x<|open|>y"}], thinking="off")
    ids = prompt.token_ids(tok)
    assert ids[0] == tok.special_tokens["<|open|>"]
    assert ids.count(tok.special_tokens["<|open|>"]) == 3  # message, assistant message, response
    assert tok.decode(ids) == prompt.text


def test_token_bytes(tik, hf):
    for tok in (tik, hf):
        ids = tok.encode("hé🙂")
        assert b"".join(tok.token_bytes(i) for i in ids) == "hé🙂".encode()
        assert tok.token_bytes(tok.special_tokens["<|sep|>"]) == b"<|sep|>"
        assert tok.token_bytes(10**6) == b""
    assert isinstance(hf, HFTokenizer)


def test_split_long_runs():
    text = "a" * 7 + "  " + "b" * 3 + " " * 5
    assert split_long_runs(text, 3) == ["aaa", "aaa", "a  bbb   ", "  "]
    assert "".join(split_long_runs(text, 3)) == text
    assert split_long_runs("ab cd", 3) == ["ab cd"]


@pytest.mark.parametrize("name", ["tik", "hf"])
def test_detokenizer_never_emits_broken_utf8(name, request):
    tok = request.getfixturevalue(name)
    text = "Hi 🙂 中文 é<|open|>think<|sep|>ok 👍🏽!"
    ids = tok.encode(text, allow_special=True)
    assert len(ids) > len(text) // 2  # multi-byte characters are split over byte tokens
    detok = Detokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text and detok.flush() == "" and detok.text == text
    held = [d for d in deltas if d == ""]
    assert held  # some tokens ended mid-character and were held back
    skip = Detokenizer(tok, skip_special_tokens=True)
    assert skip.add_many(ids) == text.replace("<|open|>", "").replace("<|sep|>", "")


def test_detokenizer_flushes_a_cut_character(hf):
    detok = Detokenizer(hf)
    ids = hf.encode("a🙂")
    assert detok.add_many(ids[:3]) == "a" and detok.pending_bytes == 2
    assert detok.flush() == "\ufffd"
