"""Plain counters for one generation; logging and metrics live at the edges.

SWI, the paper's standardized walltime improvement (CS Drafting §5):
    SWI = n / (target calls + sum_i calls_i * c_i)
with c_i a drafter's cost relative to the target: parameter-count ratio, or measured step-time ratio.
MaG costs 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

C = TypeVar("C")


@dataclass
class TierCounters:
    calls: int = 0  # forward passes (MaG: proposals)
    tokens_processed: int = 0  # tokens fed through the model, cache misses included
    tokens_out: int = 0  # tokens emitted: drafted as a leaf, or kept + replacement/bonus as a reviewer
    time_s: float = 0.0
    hops: int = 0  # calls that crossed a process boundary (remote tiers: one per block)
    tokens_cached: int = 0  # positions the tier's prefix cache gave instead of a pass (models.kvpool)


@dataclass
class ReviewCounters:
    """What one reviewer saw: drafted/accepted tokens, per block position and per contributing drafter,
    and how its K-matrix row ran block by block (invariant 7)."""

    reviews: int = 0  # blocks reviewed
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # reviews that rejected a draft (the rest kept their whole block)
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_drafter: dict[str, int] = field(default_factory=dict)
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)
    ran_by_drafter: dict[str, int] = field(default_factory=dict)  # blocks in which the row's drafter was called
    # Blocks that had ended (the token budget, the block policy's cap, an EOS) before the drafter's turn.
    ended_by_drafter: dict[str, int] = field(default_factory=dict)
    gated: int = 0  # blocks the lookup gate filled (the row did not run: core.schedule.Lookup)

    def record(
        self, origins: list[str], accepted: int, ran: Sequence[str] = (), ended: Sequence[str] = (), gated: bool = False
    ) -> None:
        for by, names in ((self.ran_by_drafter, ran), (self.ended_by_drafter, ended)):
            for name in names:
                by[name] = by.get(name, 0) + 1
        self.gated += gated
        self.reviews += 1
        self.drafted += len(origins)
        self.accepted += accepted
        self.rejections += accepted < len(origins)
        _grow(self.drafted_by_position, len(origins))
        _grow(self.accepted_by_position, len(origins))
        for i, origin in enumerate(origins):
            self.drafted_by_position[i] += 1
            self.drafted_by_drafter[origin] = self.drafted_by_drafter.get(origin, 0) + 1
            if i < accepted:
                self.accepted_by_position[i] += 1
                self.accepted_by_drafter[origin] = self.accepted_by_drafter.get(origin, 0) + 1

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def kept(self, drafter: str) -> tuple[int, int]:
        """(tokens of `drafter` this reviewer kept, tokens of it drafted and not kept)."""
        accepted = self.accepted_by_drafter.get(drafter, 0)
        return accepted, self.drafted_by_drafter.get(drafter, 0) - accepted

    def row(self) -> dict:
        """How the K-matrix row ran: the reviewer's blocks, those the lookup gate filled instead, and
        per entry (drafter) the blocks it ran in, the blocks that had ended before its turn, its share
        of the others (the blocks that left it room: under fill "entry" it runs in every one of
        them, under "total" an earlier drafter's overshoot may use its quota up), and the tokens its
        system added (its kept tokens and its bonus tokens, over every block)."""
        filled = self.reviews - self.gated
        entries = {}
        for name in {**self.ran_by_drafter, **self.ended_by_drafter}:
            ran, ended = self.ran_by_drafter.get(name, 0), self.ended_by_drafter.get(name, 0)
            room = filled - ended
            entries[name] = {
                "blocks": ran,
                "ended": ended,
                "share": ran / room if room > 0 else 0.0,
                "tokens": self.drafted_by_drafter.get(name, 0),
            }
        return {"blocks": self.reviews, "gated": self.gated, "entries": entries}


def _grow(counts: list[int], n: int) -> None:
    counts.extend([0] * (n - len(counts)))


@dataclass
class Usage:
    """What one tier call cost, per tier that worked in it (a sub-cascade runs several), what its
    reviewers saw, and the final verifier's loss accounting (core.verify). Crosses the wire as is."""

    tiers: dict[str, TierCounters] = field(default_factory=dict)
    reviews: dict[str, ReviewCounters] = field(default_factory=dict)
    off_target: int = 0
    tv: float = 0.0
    ll_loss: float = 0.0

    def tier(self, name: str) -> TierCounters:
        return _entry(self.tiers, name, TierCounters)

    def reviewer(self, name: str) -> ReviewCounters:
        return _entry(self.reviews, name, ReviewCounters)


@dataclass
class EngineTime:
    """Where a request's time went in the engine loop (engine.loop), in seconds: its share of each
    tier's batched forward passes (`pass_s`), its Python on the loop around them (`run_s`: the
    cascade's bookkeeping, MaG, reviews, sampling, detokenization) and the rest of its wall time
    (`waited_s`: its turn among the loop's tasks, remote tiers' replies, the session store)."""

    pass_s: dict[str, float] = field(default_factory=dict)
    run_s: float = 0.0
    waited_s: float = 0.0

    @property
    def wall_s(self) -> float:
        return sum(self.pass_s.values()) + self.run_s + self.waited_s

    def orchestration_s(self) -> float:
        """Wall time outside model passes: what the engine itself cost the request."""
        return self.run_s + self.waited_s


@dataclass
class CascadeStats:
    target: str
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    reviews: dict[str, ReviewCounters] = field(default_factory=dict)
    generated: int = 0
    wall_s: float = 0.0
    verification: str = "exact"  # the final verifier's rule, as Verification.describe() writes it
    off_target_tokens: int = 0  # emitted tokens drawn from a distribution other than the target's
    tv_deviation: float = 0.0  # summed expected total-variation distance from the target's distributions
    loglik_loss: float = 0.0  # summed expected drop of the target's log-likelihood (nats)
    engine: EngineTime | None = None  # the engine loop's accounting of the request's time, when it ran there
    # Per output token, when the request asked (core.review.TokenLogprob): from the target's final review.
    logprobs: list = field(default_factory=list)

    def tier(self, name: str) -> TierCounters:
        return _entry(self.tiers, name, TierCounters)

    def reviewer(self, name: str) -> ReviewCounters:
        return _entry(self.reviews, name, ReviewCounters)

    def orchestration_per_round_s(self) -> float | None:
        """The engine's own time per target round: wall time outside model passes over target calls."""
        if self.engine is None or not self.target_calls:
            return None
        return self.engine.orchestration_s() / self.target_calls

    @property
    def target_calls(self) -> int:
        return self.tier(self.target).calls

    @property
    def drafted_rounds(self) -> int:
        """Target rounds whose block held at least one draft (the rest were plain decoding steps)."""
        review = self.reviews.get(self.target)
        return review.drafted_by_position[0] if review is not None and review.drafted_by_position else 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target call (accepted drafts + the replacement or bonus token)."""
        return self.generated / self.target_calls if self.target_calls else 0.0

    def swi(self, costs: Mapping[str, float]) -> float:
        """costs: drafter name -> cost relative to one target call; tiers not listed cost 0 (MaG)."""
        spent = self.target_calls + sum(
            counters.calls * costs.get(name, 0.0) for name, counters in self.tiers.items() if name != self.target
        )
        return self.generated / spent if spent else 0.0

    def per_tier(self) -> dict[str, dict[str, int]]:
        """What each tier did: {tier: {"calls", "drafted", "accepted"}} (invariant 7: what runs is counted).

        `calls` are forward passes (MaG: proposals; `mag_lookup`: the lookup gate's proposals),
        `drafted` the tokens the tier's system proposed to its reviewers, `accepted` those they kept;
        summed over every reviewer the tier drafts for. The target drafts nothing.
        """
        out = {name: {"calls": c.calls, "drafted": 0, "accepted": 0} for name, c in self.tiers.items()}
        for review in self.reviews.values():
            for name, drafted in review.drafted_by_drafter.items():
                tier = out.setdefault(name, {"calls": 0, "drafted": 0, "accepted": 0})
                tier["drafted"] += drafted
                tier["accepted"] += review.accepted_by_drafter.get(name, 0)
        return out

    def to_dict(self, swi_costs: Mapping[str, Mapping[str, float]] | None = None) -> dict:
        """JSON-ready summary; swi_costs maps a cost-set name ("params", "measured") to its costs."""
        target_review = self.reviews.get(self.target, ReviewCounters())
        return {
            "generated_tokens": self.generated,
            "target_calls": self.target_calls,
            "tiers": self.per_tier(),
            "calls": {name: c.calls for name, c in self.tiers.items()},
            "tokens_processed": {name: c.tokens_processed for name, c in self.tiers.items()},
            "tokens_out": {name: c.tokens_out for name, c in self.tiers.items()},
            "time_s": {name: round(c.time_s, 6) for name, c in self.tiers.items()},
            "hops": {name: c.hops for name, c in self.tiers.items()},
            "accepted_by_position": list(target_review.accepted_by_position),
            "drafted_by_position": list(target_review.drafted_by_position),
            "mean_accepted_length": self.mean_accepted_length,
            "drafted_rounds": self.drafted_rounds,
            "drafted_round_share": self.drafted_rounds / self.target_calls if self.target_calls else 0.0,
            "reviews": {
                name: {
                    "reviews": r.reviews,
                    "drafted": r.drafted,
                    "accepted": r.accepted,
                    "rejections": r.rejections,
                    "acceptance_by_position": r.acceptance_by_position(),
                    "drafted_by_drafter": dict(r.drafted_by_drafter),
                    "accepted_by_drafter": dict(r.accepted_by_drafter),
                    "row": r.row(),
                }
                for name, r in self.reviews.items()
            },
            "swi": {name: self.swi(costs) for name, costs in (swi_costs or {}).items()},
            "wall_s": self.wall_s,
            "verification": self.verification,
            "off_target_tokens": self.off_target_tokens,
            "tv_deviation": round(self.tv_deviation, 6),
            "loglik_loss": round(self.loglik_loss, 6),
            "engine": None
            if self.engine is None
            else {
                "pass_s": {name: round(s, 6) for name, s in self.engine.pass_s.items()},
                "run_s": round(self.engine.run_s, 6),
                "waited_s": round(self.engine.waited_s, 6),
                "orchestration_per_round_ms": round(1e3 * (self.orchestration_per_round_s() or 0.0), 4),
            },
        }


def _entry(table: dict[str, C], name: str, make: Callable[[], C]) -> C:
    """table[name], made on its first use (setdefault built a throwaway one on every call: a round
    asks for its tiers' counters a dozen times)."""
    entry = table.get(name)
    if entry is None:
        entry = table[name] = make()
    return entry


def absorb(into: CascadeStats | Usage, usage: Usage) -> None:
    """Add what a tier call cost (`usage`) into a request's stats, or into another call's usage."""
    for name, c in usage.tiers.items():
        mine = into.tier(name)
        mine.calls += c.calls
        mine.tokens_processed += c.tokens_processed
        mine.tokens_out += c.tokens_out
        mine.time_s += c.time_s
        mine.hops += c.hops
        mine.tokens_cached += c.tokens_cached
    for name, r in usage.reviews.items():
        ours = into.reviewer(name)
        ours.reviews += r.reviews
        ours.drafted += r.drafted
        ours.accepted += r.accepted
        ours.rejections += r.rejections
        ours.gated += r.gated
        for mine_pos, theirs in (
            (ours.drafted_by_position, r.drafted_by_position),
            (ours.accepted_by_position, r.accepted_by_position),
        ):
            _grow(mine_pos, len(theirs))
            for i, v in enumerate(theirs):
                mine_pos[i] += v
        for by, sent in (
            (ours.drafted_by_drafter, r.drafted_by_drafter),
            (ours.accepted_by_drafter, r.accepted_by_drafter),
            (ours.ran_by_drafter, r.ran_by_drafter),
            (ours.ended_by_drafter, r.ended_by_drafter),
        ):
            for k, v in sent.items():
                by[k] = by.get(k, 0) + v
    if isinstance(into, CascadeStats):
        into.off_target_tokens += usage.off_target
        into.tv_deviation += usage.tv
        into.loglik_loss += usage.ll_loss
    else:
        into.off_target += usage.off_target
        into.tv += usage.tv
        into.ll_loss += usage.ll_loss
