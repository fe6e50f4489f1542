"""Constrained decoding: what a request may generate next, as a token mask over the vocabulary.

Two kinds of :class:`TokenConstraint`:

- :class:`GrammarMatcher` -- a grammar (JSON schema, regex, choice, Lark / GBNF) run by
  llguidance. :class:`GrammarCompiler` compiles each grammar once per tokenizer (an LRU cache
  keyed by the grammar text) and hands every request a copy of the compiled matcher; the batch's
  masks are computed together on llguidance's thread pool.
- :class:`PrefixConstraint` -- token healing: the output's bytes must start with given bytes
  (:func:`healing_split` picks them: the prompt's last token, when a longer token extends it).

The sampler asks :func:`allowed_tokens` for the rows that have one, applies the mask to the
logits, and the engine calls :meth:`TokenConstraint.accept` with every token it commits.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tidal.sampling_params import StructuredOutputsParams

logger = logging.getLogger("tidal.engine")

GRAMMAR_CACHE_SIZE = 128
_BITS = torch.arange(32, dtype=torch.int32)


class TokenConstraint(Protocol):
    def fill(self, words: torch.Tensor) -> None:
        """Set bit ``t % 32`` of ``words[t // 32]`` (int32, zeroed) for every allowed token t."""

    def accept(self, token_id: int) -> None:
        """The engine committed ``token_id``."""


def _set_bits(words: torch.Tensor, ids: torch.Tensor) -> None:
    """Set the bits of ``ids`` in a zeroed int32 row (int64 arithmetic, then wrapped to int32)."""
    if ids.numel() == 0:
        return
    acc = torch.zeros(words.numel(), dtype=torch.int64)
    acc.index_put_((ids // 32,), torch.ones_like(ids) << (ids % 32), accumulate=True)
    words.copy_(torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 words -> [B, vocab_size] bool (tokens past 32 W are not allowed)."""
    bits = ((bitmask[:, :, None] >> _BITS) & 1).bool().reshape(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - bits.shape[1], dtype=torch.bool)
    return torch.cat([bits, pad], dim=1)


def allowed_tokens(constraints: Sequence[TokenConstraint], vocab_size: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(constraints), vocab_size] bool: the tokens each constraint allows now. Grammar rows
    are computed in parallel by llguidance's executor, the rest one by one."""
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros(len(constraints), words, dtype=torch.int32)
    # A matcher forcing a chosen option (tidal.engine.whole_choice) fills its own one-token row.
    grammars = [(c, i) for i, c in enumerate(constraints)
                if isinstance(c, GrammarMatcher) and not getattr(c, "forcing", False)]
    if grammars:
        executor = grammars[0][0].compiler.executor
        executor.unsafe_compute_mask_ptr([(c.matcher, i) for c, i in grammars], bitmask.data_ptr(),
                                         words * 4, len(constraints))
    batched = {i for _, i in grammars}
    for i, c in enumerate(constraints):
        if i not in batched:
            c.fill(bitmask[i])
    allowed = unpack_bitmask(bitmask, vocab_size)
    for c, i in grammars:
        extra = c.extra_allowed()
        if extra:
            allowed[i, [t for t in extra if t < vocab_size]] = True
    return allowed.to(device)


# ---- grammars ------------------------------------------------------------------------------------

def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a structured-outputs request (not yet checked)."""
    import llguidance

    options = {"whitespace_flexible": spec.whitespace_flexible}
    if not spec.whitespace_flexible:
        options |= {"item_separator": ", ", "key_separator": ": "}
    kind = spec.kind
    if kind == "llguidance":
        return spec.llguidance
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_literal(c) for c in spec.choice))
    try:
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise ValueError(f"the grammar is neither Lark nor GBNF: {e}") from e


class CompiledGrammar:
    """A checked grammar with its pristine matcher; :meth:`matcher` copies it for one request."""

    def __init__(self, compiler: GrammarCompiler, text: str) -> None:
        import llguidance

        self.compiler = compiler
        self.text = text
        self._pristine = llguidance.LLMatcher(compiler.ll_tokenizer, text, log_level=0)
        if self._pristine.is_error():
            raise ValueError(f"invalid grammar: {self._pristine.get_error()}")

    def matcher(self, stop_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        return GrammarMatcher(self.compiler, self._pristine.deep_copy(), tuple(stop_token_ids))


class GrammarMatcher:
    """One request's position in its grammar. Once the grammar may end, the request's own stop
    tokens are allowed too (llguidance allows its end-of-sequence tokens only)."""

    def __init__(self, compiler: GrammarCompiler, matcher: Any, stop_token_ids: tuple[int, ...]) -> None:
        self.compiler = compiler
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.failed: str | None = None

    def fill(self, words: torch.Tensor) -> None:
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def extra_allowed(self) -> tuple[int, ...]:
        return self.stop_token_ids if self.matcher.is_accepting() else ()

    @property
    def finished(self) -> bool:
        """The grammar has matched completely (nothing but a stop token may follow)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()

    def accept(self, token_id: int) -> None:
        if self.failed is not None or self.matcher.is_stopped():
            return
        if token_id in self.stop_token_ids and token_id not in self.compiler.eos_token_ids:
            return  # the request ends on it
        if not self.matcher.consume_token(token_id):
            self.failed = self.matcher.get_error()
            logger.warning("grammar rejected committed token %d: %s", token_id, self.failed)


class GrammarCompiler:
    """llguidance over one tokenizer: its token table built once, compiled grammars cached (LRU,
    ``GRAMMAR_CACHE_SIZE`` entries). Thread safe: the server compiles on worker threads so the
    engine thread only copies."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int | None = None) -> None:
        import llguidance

        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        n = vocab_size or tokenizer.vocab_size
        wrapper = llguidance.TokenizerWrapper(_TokenTable(tokenizer, n, self.eos_token_ids))
        self.ll_tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=n, eos_token=list(self.eos_token_ids))
        self.executor = llguidance.LLExecutor()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, spec: StructuredOutputsParams | str) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (or of llguidance grammar text); ValueError naming
        the problem when it is invalid."""
        text = spec if isinstance(spec, str) else grammar_text(spec)
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        compiled = CompiledGrammar(self, text)
        with self._lock:
            self.num_compiled += 1
            self._cache[text] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


class _TokenTable:
    """What llguidance's TokenizerWrapper reads of a tokenizer: every token's bytes, the special
    ids, and an encoder (used to tokenise grammar literals)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tok = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i in tokenizer.special_ids if i < vocab_size)
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tok.encode(text))


# ---- token healing -------------------------------------------------------------------------------

class TokenTrie:
    """The ordinary tokens' bytes sorted, to find the tokens that start with given bytes (one
    contiguous run) and the tokens that are a prefix of them (one lookup per length)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        special = tokenizer.special_ids
        pairs = sorted((tokenizer.token_bytes(i), i) for i in range(vocab_size) if i not in special)
        pairs = [(b, i) for b, i in pairs if b]
        self.keys = [b for b, _ in pairs]
        self.ids = torch.tensor([i for _, i in pairs], dtype=torch.long)
        self.by_bytes = {b: i for b, i in pairs}
        self.bytes_of = {i: b for b, i in pairs}
        self.vocab_size = vocab_size

    def allowed(self, prefix: bytes) -> torch.Tensor:
        """Ids of tokens whose bytes start with ``prefix`` or are a proper prefix of it."""
        lo = bisect.bisect_left(self.keys, prefix)
        hi = lo
        # The run of keys starting with prefix: binary search for its end.
        step_hi = len(self.keys)
        while hi < step_hi:
            mid = (hi + step_hi) // 2
            if self.keys[mid].startswith(prefix):
                hi = mid + 1
            else:
                step_hi = mid
        shorter = [self.by_bytes[prefix[:k]] for k in range(1, len(prefix)) if prefix[:k] in self.by_bytes]
        return torch.cat([self.ids[lo:hi], torch.tensor(shorter, dtype=torch.long)])

    def extends(self, prefix: bytes) -> bool:
        """Some token's bytes start with ``prefix`` and are longer."""
        i = bisect.bisect_right(self.keys, prefix)
        return i < len(self.keys) and self.keys[i].startswith(prefix)


def healing_split(prompt_token_ids: Sequence[int], trie: TokenTrie) -> int | None:
    """Token healing (as transformers' ``token_healing`` and guidance do it): the prompt's last
    token when a longer token starts with its bytes -- the prompt then ends inside what the
    tokenizer would have made one token had the text gone on (``"):\n"`` before an indent,
    ``"bro"`` of ``"brown"``). The engine backs the prompt off by that token and constrains the
    output to start with its bytes. None when there is nothing to heal (a single-token prompt,
    a special token, a token nothing extends)."""
    if len(prompt_token_ids) < 2:
        return None
    last = prompt_token_ids[-1]
    key = trie.bytes_of.get(last)
    return last if key is not None and trie.extends(key) else None


class PrefixConstraint:
    """The next tokens must spell ``prefix`` (bytes), the last of them possibly running past it."""

    def __init__(self, trie: TokenTrie, tokenizer: Any, prefix: bytes) -> None:
        self.trie = trie
        self.tokenizer = tokenizer
        self.remaining = prefix

    @property
    def finished(self) -> bool:
        return not self.remaining

    def fill(self, words: torch.Tensor) -> None:
        _set_bits(words, self.trie.allowed(self.remaining))

    def past(self, token_id: int) -> bytes | None:
        """The bytes of ``token_id`` beyond the prefix still to spell; None when it lies wholly
        inside it (it only re-spells the prompt)."""
        b = self.tokenizer.token_bytes(token_id)
        return None if self.remaining.startswith(b) else b[len(self.remaining):]

    def accept(self, token_id: int) -> None:
        b = self.tokenizer.token_bytes(token_id)
        self.remaining = self.remaining[len(b):] if self.remaining.startswith(b) else b""
