"""Plain steps that hand a hidden-state drafter (DSPARK) nothing, and the gaps they leave.

The drafter reads, for a request of n tokens, the target's tapped hidden states at its committed
positions n-1-window .. n-2 (its context). Keeping them costs every step a gather of the taps in
the forward and a copy into the drafter's cache, also in steps that do not speculate. Where the
cost policy has decided chains lose (a compute-bound batch; no shadow drafts there) and no probe
is due within two windows of steps, a decode-only step asks for no taps
(:meth:`SpecDecoder.plan_taps`), and each of its requests records the position it left out. A request drafts (in a
chain or a shadow) only once its whole window lies past its last gap (``window`` tapped steps
later), so every draft reads exactly the context it would have read had every step been tapped:
drafts, and with them the chains and their acceptance, are those of an engine that always taps.
The price is that a request resumes drafting up to ``window`` steps after chains turn back on in
its bucket (a probe is scheduled further out than that, so it does not wait).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.engine.request import Request


@dataclass
class ContextGaps:
    window: int  # the drafter's context: the last ``window`` committed positions
    # request id -> the position after its last untapped one
    after: dict[str, int] = field(default_factory=dict)

    def skip(self, requests: list[Request], cached_lens: list[int]) -> None:
        """A decode-only step ran untapped: each request's computed position is left out."""
        for req, c in zip(requests, cached_lens):
            self.after[req.request_id] = c + 1

    def complete(self, req: Request) -> bool:
        """Whether ``req``'s context (its positions num_tokens-1-window .. num_tokens-2) is whole."""
        gap = self.after.get(req.request_id)
        if gap is None:
            return True
        if req.num_tokens - 1 - self.window < gap:
            return False
        del self.after[req.request_id]
        return True

    def forget(self, request_id: str) -> None:
        self.after.pop(request_id, None)
