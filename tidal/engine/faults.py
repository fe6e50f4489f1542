"""Engine faults: what a failed step leaves behind, and the test hooks that cause one.

A step that raises fails only its own requests: they are aborted (their state blocks and pages
freed, nothing handed to the prefix cache, since a failed step may have half-advanced a KDA
state in place) and reported with :class:`StepFailedError`. The engine then recounts its pool
(:func:`tidal.cache.recount.recount`); if the books do not balance the engine is dead: it steps
no more and says why (``EngineCore.dead``).

Test hooks (``TIDAL_FAULT_INJECTION``, read at engine start): ``raise-at-step:N`` makes the model
raise in the N-th step (1-based); ``corrupt-pool-at-step:N`` leaks a free page from the pool's
books before the N-th step and makes it raise, so the recount fails.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FAULT_ENV = "TIDAL_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """Raised by the test hook in place of a real failure."""


class WorkerLostError(RuntimeError):
    """The step's worker can no longer run steps (a rank process died or hung): the engine is dead."""


class StepFailedError(RuntimeError):
    """A step raised: ``request_ids`` (the step's requests) were aborted; ``dead`` is the reason
    the engine can no longer serve, None when the recount found the pool intact."""

    def __init__(self, cause: BaseException, request_ids: list[str], dead: str | None) -> None:
        super().__init__(f"the engine step failed: {type(cause).__name__}: {cause}")
        self.cause = cause
        self.request_ids = request_ids
        self.dead = dead


@dataclass
class FaultInjection:
    raise_at_step: int | None = None
    corrupt_pool_at_step: int | None = None

    @classmethod
    def from_env(cls) -> FaultInjection | None:
        spec = os.environ.get(FAULT_ENV, "").strip()
        if not spec:
            return None
        kind, _, step = spec.partition(":")
        if kind not in ("raise-at-step", "corrupt-pool-at-step") or not step.isdigit() or int(step) < 1:
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected raise-at-step:N or corrupt-pool-at-step:N (N >= 1)")
        return cls(**{kind.replace("-", "_"): int(step)})

    def before_step(self, step: int, pool) -> None:
        """Called at the start of the engine's ``step``-th step (1-based), inside its fault guard."""
        if step == self.corrupt_pool_at_step:
            pool.leak_page_for_test()
            raise InjectedFault(f"injected pool corruption at step {step}")
        if step == self.raise_at_step:
            raise InjectedFault(f"injected fault at step {step}")
