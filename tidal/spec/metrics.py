"""Speculation counters (SGLang/vLLM vocabulary): drafted vs accepted tokens, accept length."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Over verified chains since start. The accept length of a chain counts its committed
    tokens: accepted drafts + the one token the target adds (DeepSpec's tau, SGLang's
    avg_spec_accept_length); plain decodes in the same steps are not chains and not counted."""

    num_draft_tokens: int = 0  # the configured k
    num_chains: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0  # accepted drafts (without the added token)
    # accept_length_counts[n]: chains that committed n tokens (1 .. k+1)
    accept_length_counts: list[int] = field(default_factory=list)
    # per position i (draft i+1): chains that drafted it, and that accepted it
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        self.accept_length_counts = self.accept_length_counts or [0] * (k + 2)
        self.position_drafted = self.position_drafted or [0] * k
        self.position_accepted = self.position_accepted or [0] * k

    def record(self, drafted: int, accepted: int, committed: int) -> None:
        """One chain: ``drafted`` drafts, the first ``accepted`` taken, ``committed`` tokens
        emitted (accepted + 1, or fewer when the request finished inside the chain)."""
        self.num_chains += 1
        self.num_drafted_tokens += drafted
        self.num_accepted_tokens += accepted
        self.accept_length_counts[min(committed, len(self.accept_length_counts) - 1)] += 1
        for i in range(drafted):
            self.position_drafted[i] += 1
            self.position_accepted[i] += int(i < accepted)

    @property
    def avg_accept_length(self) -> float:
        """Committed tokens per verified chain (0 before any)."""
        if not self.num_chains:
            return 0.0
        return sum(n * c for n, c in enumerate(self.accept_length_counts)) / self.num_chains

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0

    def position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]
