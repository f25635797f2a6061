"""Per-request acceptance window for speculative decoding: a request whose recent drafts were mostly
rejected stops proposing for a while, then probes again.

Verifying k drafts costs a step more than decoding one token (on a compute-bound CPU each draft
row costs nearly what a decoded token does, more so in larger batches; bench/RESULTS.md,
"Speculative decoding"), and pays
only when enough drafts are accepted. Whether they are depends on the request: an answer that
copies its prompt accepts most n-gram drafts, one written from scratch few. So each request keeps
the outcome of its last `window` verification steps (drafts proposed, drafts accepted); once that
many are in and fewer than `min_acceptance` of their drafts were accepted, it decodes without
drafts for `backoff_steps` steps. The next verification after a back-off is a probe judged on its
own: accepted enough, the request speculates again (a copying passage has started); otherwise it
backs off once more. Steps whose proposer found no draft (an n-gram with no match) verify nothing
and count for nothing: they cost no more than a plain decode.

Only which requests verify drafts changes, never what a verification emits, so speculation stays
lossless.

Part of the engine's contract with the operator (beside config.py, copied into the operator's
image): the planner runs this same window over simulated requests to predict how many steps verify
(operator/planning/speculation.py), so it must stay free of anything but the standard library.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class AcceptancePolicy:
    window: int  # verification steps judged together
    min_acceptance: float  # accepted / proposed drafts below which the request backs off; 0: never
    backoff_steps: int  # sampling steps without drafts before the probe


class AcceptanceWindow:
    """One request's recent verification steps, and whether it proposes drafts now."""

    def __init__(self, policy: AcceptancePolicy) -> None:
        self.policy = policy
        self.steps: deque[tuple[int, int]] = deque(maxlen=policy.window)  # (proposed, accepted)
        self.paused_steps = 0  # left in the current back-off
        self.probing = False  # the next verification is judged on its own (a back-off has ended)

    @property
    def proposes(self) -> bool:
        return self.paused_steps == 0

    @property
    def acceptance(self) -> float:
        proposed = sum(p for p, _ in self.steps)
        return sum(a for _, a in self.steps) / proposed if proposed else 1.0

    def record(self, proposed: int, accepted: int) -> None:
        """A verification step of `proposed` drafts, `accepted` of them kept."""
        self.steps.append((proposed, accepted))
        if not (self.probing or len(self.steps) == self.policy.window):
            return
        self.probing = False
        if self.acceptance < self.policy.min_acceptance:
            self.paused_steps = self.policy.backoff_steps
            self.probing = True
            self.steps.clear()

    def tick(self) -> None:
        """A step in which the request sampled without verifying drafts."""
        self.paused_steps = max(0, self.paused_steps - 1)
