"""The per-step batch description the model reads, and the cache interface behind it.

One model step runs a flat run of tokens: the new tokens of B sequences, concatenated in batch
order. ``ForwardBatch`` says how many tokens each sequence brings (``query_lens``) and how many it
already has cached (``cached_lens``); ``SequenceCache`` is where the KDA states and the MLA latents
of those B sequences live. The model never knows whether that storage is a per-request tensor
(``SimpleCache``, the reference) or pages of the engine's shared pool.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tidal.config import ModelConfig
from tidal.ops.mla import pad_latents


class SequenceCache(Protocol):
    """Cache storage for the B sequences of one step, indexed by batch position.

    KDA states live in slots of per-layer storage tensors; the model reads and updates the slots
    of its sequences (``state_slots``) in place, through views where the slots are consecutive."""

    state_slots: list[int]  # storage slot of each batch position's KDA state

    def kda_storage(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [N, W-1, 3P] model dtype, recurrent [N, H, K, V] float32) of every slot."""
        ...

    def mla_write(self, mla_layer: int, latents: torch.Tensor) -> None:
        """Append this step's latents [T, kv_lora_rank + rope] (T = sum of query_lens)."""
        ...

    def mla_read(self, mla_layer: int, seq: int) -> torch.Tensor:
        """All latents of sequence ``seq`` including this step's: [cached_len + query_len, C]."""
        ...

    def mla_read_padded(self, mla_layer: int, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents of ``seqs`` zero-padded to the longest, [n, L, C], and their lengths [n]."""
        ...


@dataclass(frozen=True)
class StateRun:
    """Sequences whose KDA state slots are consecutive, ``start .. start + count - 1`` in batch
    order: one strided view of the storage holds all their states. ``tokens`` indexes their
    (single) tokens in the flat run: a slice when those are consecutive too."""

    seqs: list[int]
    start: int
    tokens: slice | torch.Tensor

    @property
    def count(self) -> int:
        return len(self.seqs)

    @property
    def slots(self) -> slice:
        return slice(self.start, self.start + len(self.seqs))


@dataclass
class ForwardBatch:
    """Token layout of one step. ``input_ids`` given to the model is the concatenation of the
    sequences' new tokens, ``query_lens[b]`` of them for sequence b, which already has
    ``cached_lens[b]`` tokens in ``cache``."""

    query_lens: list[int]
    cached_lens: list[int]
    cache: SequenceCache
    # Speculative verify (tidal.spec.verify.VerifyLayout): sequences whose tokens are a drafted
    # chain, run position by position with the decode kernels; neither decodes nor prefills.
    verify: Any = None
    # Target layers whose output hidden state the forward keeps in ``taps`` (layer -> [T, d]):
    # what a DSPARK drafter is conditioned on (tidal.spec.dspark), taken from the step itself.
    tap_layers: tuple[int, ...] = ()
    taps: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _cu: list[int] = field(default_factory=list, repr=False)
    _rows: dict[str, object] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.query_lens) != len(self.cached_lens):
            raise ValueError("query_lens and cached_lens differ in length")
        cu = [0]
        for n in self.query_lens:
            cu.append(cu[-1] + n)
        self._cu = cu
        # Every attention layer runs single-token sequences together and longer ones one by one;
        # the split is the same for all layers, so it is computed once per step.
        chains = set(self.verify.seqs) if self.verify is not None else set()
        self.verify_seqs = sorted(chains)
        self.decode_seqs = [b for b, n in enumerate(self.query_lens) if n == 1 and b not in chains]
        self.prefill_seqs = [b for b, n in enumerate(self.query_lens) if n > 1 and b not in chains]

    def decode_tokens(self, device: torch.device) -> torch.Tensor:
        """Positions in the flat token run of the single-token sequences' tokens, built once per
        step and device."""
        key = str(device)
        if key not in self._rows:
            self._rows[key] = torch.tensor([self._cu[b] for b in self.decode_seqs], dtype=torch.long, device=device)
        return self._rows[key]  # type: ignore[return-value]

    def decode_slots(self, device: torch.device) -> torch.Tensor:
        """KDA state slots of the single-token sequences, in decode_seqs order (device kernels
        index the pool with them; -1 marks a padded row of a captured batch)."""
        key = "slots " + str(device)
        if key not in self._rows:
            slots = self.cache.state_slots
            self._rows[key] = torch.tensor([slots[b] for b in self.decode_seqs], dtype=torch.int32, device=device)
        return self._rows[key]  # type: ignore[return-value]

    def decode_cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """Offsets 0, 1, .., n of the single-token sequences' tokens (varlen kernels); a captured
        batch repeats the last live offset for its padded rows, which then hold no token."""
        key = "cu " + str(device)
        if key not in self._rows:
            self._rows[key] = torch.arange(len(self.decode_seqs) + 1, dtype=torch.long, device=device)
        return self._rows[key]  # type: ignore[return-value]

    def set_device_index(self, name: str, device: torch.device, tensor: torch.Tensor) -> None:
        """Use ``tensor`` (a static buffer of a captured CUDA graph) as this step's ``name`` index
        ("tokens", "slots" or "cu") on ``device``."""
        prefix = {"tokens": "", "slots": "slots ", "cu": "cu "}[name]
        self._rows[prefix + str(device)] = tensor

    def decode_runs(self, device: torch.device) -> list[StateRun]:
        """The single-token sequences grouped into runs of consecutive state slots (built once per
        step): the engine orders a batch by slot, so a decode step is usually one or a few runs."""
        key = "runs " + str(device)
        if key not in self._rows:
            slots = self.cache.state_slots
            runs: list[StateRun] = []
            group: list[int] = []
            for b in sorted(self.decode_seqs, key=lambda b: slots[b]):
                if group and slots[b] != slots[group[-1]] + 1:
                    runs.append(self._run(group, device))
                    group = []
                group.append(b)
            if group:
                runs.append(self._run(group, device))
            self._rows[key] = runs  # type: ignore[assignment]
        return self._rows[key]  # type: ignore[return-value]

    def _run(self, seqs: list[int], device: torch.device) -> StateRun:
        tokens = [self._cu[b] for b in seqs]
        if tokens == list(range(tokens[0], tokens[0] + len(tokens))):
            index: slice | torch.Tensor = slice(tokens[0], tokens[0] + len(tokens))
        else:
            index = torch.tensor(tokens, dtype=torch.long, device=device)
        return StateRun(seqs=list(seqs), start=self.cache.state_slots[seqs[0]], tokens=index)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self._cu[-1]

    @property
    def cu_seqlens(self) -> list[int]:
        """Start offsets of each sequence in the flat token run, plus the total at the end."""
        return self._cu

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one token and has a history (pure decode step)."""
        return not self.verify_seqs and all(n == 1 for n in self.query_lens)

    def token_slice(self, seq: int) -> slice:
        return slice(self._cu[seq], self._cu[seq + 1])

    def last_token_indices(self) -> list[int]:
        """Index in the flat run of each sequence's last new token (whose logits sample next)."""
        return [self._cu[b + 1] - 1 for b in range(self.num_seqs)]


class SimpleCache:
    """Reference cache: plain per-sequence tensors that grow with every step.

    Used by tests, the offline reference path and anywhere paging does not matter. On a decode-
    context-parallel rank (``dcp_size`` > 1) it keeps the MLA latents of the logical tokens i with
    i % dcp_size == dcp_rank only, in order (``tidal.parallel.dcp``).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_seqs: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        dcp_rank: int = 0,
        dcp_size: int = 1,
    ) -> None:
        self.config = config
        self.num_seqs = num_seqs
        self.dcp_rank, self.dcp_size = dcp_rank, dcp_size
        self._cached_lens: list[int] = []
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.kda_conv = [
            torch.zeros(num_seqs, *config.kda_conv_state_shape, dtype=dtype, device=device)
            for _ in range(config.num_kda_layers)
        ]
        self.kda_recurrent = [
            torch.zeros(num_seqs, *config.kda_recurrent_state_shape, dtype=state_dtype, device=device)
            for _ in range(config.num_kda_layers)
        ]
        empty = torch.zeros(0, config.mla_cache_width, dtype=dtype, device=device)
        self.mla = [[empty] * num_seqs for _ in range(config.num_mla_layers)]
        self._query_lens: list[int] = []
        self.state_slots = list(range(num_seqs))

    def bind(self, batch: ForwardBatch) -> None:
        """Tell the cache the layout of the step about to run (needed to split mla_write)."""
        if batch.num_seqs != self.num_seqs:
            raise ValueError(f"batch has {batch.num_seqs} sequences, cache holds {self.num_seqs}")
        self._query_lens = list(batch.query_lens)
        self._cached_lens = list(batch.cached_lens)

    def seq_len(self, seq: int) -> int:
        return self.mla[0][seq].shape[0] if self.mla else -1

    def kda_storage(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kda_conv[kda_layer], self.kda_recurrent[kda_layer]

    def kda_state(self, kda_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent) of every sequence, for inspection (the tensors the model updates)."""
        return self.kda_conv[kda_layer], self.kda_recurrent[kda_layer]

    def set_kda_state(self, kda_layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.kda_conv[kda_layer] = conv
        self.kda_recurrent[kda_layer] = recurrent

    def set_mla(self, mla_layer: int, seq: int, latents: torch.Tensor) -> None:
        """Make ``latents`` [n, C] sequence ``seq``'s cached latents of one MLA layer."""
        self.mla[mla_layer][seq] = latents.to(self.mla[mla_layer][seq].dtype)

    def fork(self) -> "SimpleCache":
        """A copy to run further tokens on, leaving this one as it is: its own KDA states (the model
        updates those in place), the latents shared (mla_write replaces a sequence's tensor and
        never writes into it)."""
        other = copy.copy(self)
        other.kda_conv = [t.clone() for t in self.kda_conv]
        other.kda_recurrent = [t.clone() for t in self.kda_recurrent]
        other.mla = [list(layer) for layer in self.mla]
        other._cached_lens, other._query_lens = list(self._cached_lens), list(self._query_lens)
        other.state_slots = list(self.state_slots)
        return other

    def mla_write(self, mla_layer: int, latents: torch.Tensor) -> None:
        parts = torch.split(latents, self._query_lens)
        layer = self.mla[mla_layer]
        for b, part in enumerate(parts):
            if self.dcp_size > 1:  # this rank's tokens: logical position % dcp_size == dcp_rank
                first = (self.dcp_rank - self._cached_lens[b]) % self.dcp_size
                part = part[first :: self.dcp_size]
            layer[b] = torch.cat([layer[b], part.to(layer[b].dtype)])

    def mla_read(self, mla_layer: int, seq: int) -> torch.Tensor:
        return self.mla[mla_layer][seq]

    def mla_read_padded(self, mla_layer: int, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return pad_latents([self.mla[mla_layer][b] for b in seqs])


def simple_batch(
    config: ModelConfig,
    query_lens: list[int],
    cache: SimpleCache,
    cached_lens: list[int],
) -> ForwardBatch:
    """A ForwardBatch over a SimpleCache, bound and ready to run."""
    batch = ForwardBatch(query_lens=list(query_lens), cached_lens=list(cached_lens), cache=cache)
    cache.bind(batch)
    return batch
