"""The block-policy hook: how long the target's block may be each round, and what the round taught.

The cascade asks its policy at fixed points of every target round and knows nothing else about it:
`begin` (the round starts, after so many committed tokens, so many left), `allows` (whether a source
may draft this round at all: asked before the lookup gate runs and before the model drafters' row
does, so a source that may not draft costs nothing), `cap` (how far the block may grow: for the lookup
gate's continuation, or for the model drafters' K-matrix row), `drafted` (drafting is over, the review
follows; not called in a round whose block stayed empty because nothing was let draft, or the last
token left no room: core.cascade.CascadeTier._block) and `observe` (what the review kept). The fixed
K-matrix is the policy that never caps (`FIXED`); load adaptation (`engine.policies.load.DraftBudget`)
caps by measured acceptance and the current batch; the floor under the speedup
(`engine.policies.floor.GoodputFloor`, the default) lets a source draft only while the request's
measured rounds say drafting beats plain decoding. A drafter's own stopping rule (SpecDec++, adaptive
draft length) ends its part of a block inside the tier and says so in its reply
(`core.tier.DraftReply.stopped`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

SOURCES = ("lookup", "model")  # what fills a target's block: MaG's lookup gate, or the model drafters
ARMS = ("full", "budget", "lookup", "plain")
"""How much a round may draft, tried against each other by engine.policies.trial.ArmTrial:
- "full": all the schedule offers (the fixed K-matrix and lookup);
- "budget": each request's DraftBudget cap from E(k) / cost(k);
- "lookup": MaG lookups only (budgeted), no model drafts;
- "plain": no drafts at all (plain decoding of the target)."""


class BlockPolicy(Protocol):
    def begin(self, committed: int = 0, remaining: int = 0) -> None:
        """A target round starts after `committed` tokens (the context, prompt included), with at most
        `remaining` new tokens left to the request."""

    def allows(self, source: str) -> bool:
        """Whether `source` may draft this round (False: it is not even asked for drafts)."""
        ...

    def cap(self, source: str, offered: int, ceiling: int) -> int:
        """The block's bound this round: `offered` drafts from `source` are on the table (the K-matrix
        row's total, or the lookup's length) under the hard bound `ceiling`; at most `ceiling`."""
        ...

    def drafted(self) -> None:
        """Drafting is over; the review follows."""

    def observe(self, drafted: int, accepted: int) -> None:
        """The review kept `accepted` of `drafted` tokens."""


class FixedBlocks:
    """The K-matrix as configured: every round drafts what its row says."""

    def begin(self, committed: int = 0, remaining: int = 0) -> None:
        pass

    def allows(self, source: str) -> bool:
        return True

    def cap(self, source: str, offered: int, ceiling: int) -> int:
        return ceiling

    def drafted(self) -> None:
        pass

    def observe(self, drafted: int, accepted: int) -> None:
        pass


FIXED = FixedBlocks()


class NoDrafts:
    """Plain decoding of the target through the cascade's engine: every round's block is empty, so no
    drafter runs and the target emits one token per pass (a request's `speculation` "off")."""

    def begin(self, committed: int = 0, remaining: int = 0) -> None:
        pass

    def allows(self, source: str) -> bool:
        return False

    def cap(self, source: str, offered: int, ceiling: int) -> int:
        return 0

    def drafted(self) -> None:
        pass

    def observe(self, drafted: int, accepted: int) -> None:
        pass


OFF = NoDrafts()

# A request's speculation mode -> its target's block policy, given the server's per-request policies
# (called with whether the request is greedy and its scope, the API key's cache salt: what a policy
# learns from requests stays within one key; None where the server runs the K-matrix as configured).
# "auto": what the server runs; "fixed": the K-matrix as configured, whatever the load; "off": no drafts.
PolicyFactory = Callable[[bool, str], BlockPolicy]
SPECULATION: dict[str, Callable[[PolicyFactory | None, bool, str], BlockPolicy]] = {
    "auto": lambda policies, greedy, scope: policies(greedy, scope) if policies is not None else FIXED,
    "fixed": lambda policies, greedy, scope: FIXED,
    "off": lambda policies, greedy, scope: OFF,
}
