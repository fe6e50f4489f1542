"""Speculative decoding settings, in SGLang's vocabulary (``--speculative-*``)."""

from __future__ import annotations

from dataclasses import dataclass, field

ALGORITHMS = ("NGRAM", "STANDALONE", "DSPARK")
# Algorithms this build can run (the others are named so that asking for them gets a clear error).
IMPLEMENTED = ("NGRAM", "STANDALONE", "DSPARK")
# Drafted tokens per step when neither --speculative-num-draft-tokens nor (DSPARK)
# --speculative-dspark-block-size is given: a DSPARK block costs about the same to draft at any
# size, so it drafts more than the per-token drafters (benchmarks/bench_spec.py --k).
DEFAULT_NUM_DRAFT_TOKENS = 4
DEFAULT_DSPARK_BLOCK_SIZE = 7


@dataclass
class SpeculativeConfig:
    """``num_draft_tokens`` tokens are drafted per request and step; the verified chain is one
    longer (the last committed token + the drafts). Rollback of the KDA state: by default every
    chain position writes its own state block and the accepted one is kept (a block swap);
    ``enable_linear_replayssm_spec`` keeps the committed state as the checkpoint and replays the
    accepted tokens' stored inputs into it (SGLang's --enable-linear-replayssm-spec)."""

    algorithm: str = "NGRAM"
    num_draft_tokens: int | None = None  # None: DEFAULT_NUM_DRAFT_TOKENS (DSPARK: DEFAULT_DSPARK_BLOCK_SIZE)
    draft_model_path: str | None = None
    dspark_block_size: int | None = None
    enable_linear_replayssm_spec: bool = False
    # NGRAM: the longest and shortest suffix looked up in the request's own tokens.
    ngram_max_match: int = 4
    ngram_min_match: int = 1
    # Speculate only in steps with at most this many sequences (0: no fixed limit).
    max_spec_batch: int = 0
    # Decide from measured costs whether a step speculates (tidal.spec.policy: seconds per
    # committed token with and without chains, per batch size); False: always, where drafts exist.
    adaptive: bool = True
    # A request whose chain accepted less than this fraction of its drafts decodes plainly for its
    # next 1, 2, 4, ... steps (doubling while its chains keep failing; tidal.spec.policy.RequestBackoff):
    # a chain that is rejected costs more than a decode.
    min_accept_rate: float = 0.25
    # Whether num_draft_tokens was defaulted (then a DSPARK block is cut to the drafter's trained
    # block size: tidal.spec.decoder.make_drafter); set from num_draft_tokens, never passed.
    default_num_draft_tokens: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        algo = (self.algorithm or "").upper()
        if algo not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if algo not in IMPLEMENTED:
            raise ValueError(f"speculative_algorithm {algo} is not implemented yet (implemented: "
                             f"{', '.join(IMPLEMENTED)})")
        self.algorithm = algo
        if algo in ("STANDALONE", "DSPARK") and not self.draft_model_path:
            raise ValueError(f"speculative_algorithm {algo} needs speculative_draft_model_path")
        if self.dspark_block_size is not None and algo == "DSPARK":
            self.num_draft_tokens = self.dspark_block_size
        self.default_num_draft_tokens = self.num_draft_tokens is None
        if self.num_draft_tokens is None:
            self.num_draft_tokens = DEFAULT_DSPARK_BLOCK_SIZE if algo == "DSPARK" else DEFAULT_NUM_DRAFT_TOKENS
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"speculative_num_draft_tokens must be in 1..64, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min_match <= self.ngram_max_match:
            raise ValueError(f"ngram match lengths need 1 <= min ({self.ngram_min_match}) <= max "
                             f"({self.ngram_max_match})")
        if not 0.0 <= self.min_accept_rate < 1.0:
            raise ValueError(f"min_accept_rate must be in [0, 1), got {self.min_accept_rate}")
        if self.max_spec_batch < 0:
            raise ValueError(f"max_spec_batch must be >= 0, got {self.max_spec_batch}")

    @property
    def rollback(self) -> str:
        """"replay" (checkpoint + replay) or "swap" (a state block per chain position)."""
        return "replay" if self.enable_linear_replayssm_spec else "swap"

    @classmethod
    def from_args(cls, algorithm: str | None, num_draft_tokens: int | None = None,
                  draft_model_path: str | None = None, dspark_block_size: int | None = None,
                  enable_linear_replayssm_spec: bool = False) -> "SpeculativeConfig | None":
        """The config the flags/kwargs ask for; None without an algorithm (the other flags then
        must be unset)."""
        if algorithm is None:
            if num_draft_tokens is not None or draft_model_path or dspark_block_size or enable_linear_replayssm_spec:
                raise ValueError("speculative_* options need speculative_algorithm (NGRAM, STANDALONE or DSPARK)")
            return None
        kw = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}
        return cls(algorithm=algorithm, draft_model_path=draft_model_path, dspark_block_size=dspark_block_size,
                   enable_linear_replayssm_spec=enable_linear_replayssm_spec, **kw)
