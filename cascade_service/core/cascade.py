"""The recursive cascade (CS Drafting, Algorithm 1) built by composition.

A reviewer plus the drafters below it is itself a drafter (`CascadeDrafter`), so the vertical
cascade is nesting and the horizontal cascade is the ordered list of drafters inside one reviewer.
The target's system is the outermost `CascadeDrafter`, reviewing strictly; there is no second copy
of the recursion anywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .mag import MaxGram
from .review import ReviewRule, rule_for
from .sampling import SamplingParams, sample
from .schedule import Schedule
from .stats import CascadeStats, TierCounters
from .types import Context, Draft, Drafter, Scorer


@dataclass
class RequestState:
    """What every drafter of one request shares."""

    sampling: SamplingParams
    generator: torch.Generator
    stats: CascadeStats
    vocab_size: int
    eos_ids: frozenset[int] = frozenset()


def _score(scorer: Scorer, ctx: Context, n: int, counters: TierCounters) -> torch.Tensor:
    start = time.perf_counter()
    logits = scorer.logits(ctx, n)
    counters.time_s += time.perf_counter() - start
    counters.calls += 1
    counters.tokens_processed = scorer.tokens_processed
    return logits


class ModelDrafter:
    """A model drafting alone, one token per forward pass (a leaf of the cascade)."""

    def __init__(self, scorer: Scorer, state: RequestState):
        self.name = scorer.name
        self.scorer = scorer
        self.state = state
        self.counters = state.stats.tier(self.name)

    def draft(self, ctx: Context, want: int, limit: int) -> Draft:
        sampling = self.state.sampling
        tokens: list[int] = []
        token_probs: list[float] = []
        rows: list[torch.Tensor] = []
        for _ in range(min(want, limit)):
            probs = sampling.probs(_score(self.scorer, ctx.extend(tokens), 1, self.counters))[0]  # [V]
            token = int(probs.argmax()) if sampling.greedy else sample(probs, self.state.generator)
            tokens.append(token)
            token_probs.append(float(probs[token]))
            rows.append(probs)
            if token in self.state.eos_ids:  # nothing after EOS can be kept
                break
        self.counters.tokens_out += len(tokens)
        dists = None if sampling.greedy else _stack(rows, self.state.vocab_size)
        return Draft(tokens, token_probs, dists, [self.name] * len(tokens))


class MaGDrafter:
    """Max-Gram proposals as a drafter: a point mass on each proposed token (Algorithm 1, base case)."""

    name = "mag"

    def __init__(self, mag: MaxGram, state: RequestState):
        self.mag = mag
        self.state = state
        self.counters = state.stats.tier(self.name)

    def draft(self, ctx: Context, want: int, limit: int) -> Draft:
        start = time.perf_counter()
        tokens = self.mag.propose(ctx, min(want, limit))
        self.counters.time_s += time.perf_counter() - start
        self.counters.calls += 1
        self.counters.tokens_out += len(tokens)
        dists = None
        if not self.state.sampling.greedy:
            dists = torch.zeros(len(tokens), self.state.vocab_size)
            dists[torch.arange(len(tokens)), tokens] = 1.0
        return Draft(tokens, [1.0] * len(tokens), dists, [self.name] * len(tokens))


class CascadeDrafter:
    """A reviewer over drafters: fills a block by its K-matrix row, reviews it in one forward pass.

    Steps (Algorithm 1):
    1. Horizontal cascade: each drafter in order extends the block until it holds that drafter's
       cumulative quota; a drafter that returns nothing hands over to the next one.
    2. Score context + block in ONE forward pass: k + 1 next-token distributions.
    3. Review left to right (leniency l at inner reviews, 1 at the final one); emit the kept drafts
       plus the replacement or bonus token, with their true proposal distributions for the level above.
    """

    def __init__(
        self,
        scorer: Scorer,
        drafters: Sequence[tuple[Drafter, int]],
        rule: ReviewRule,
        leniency: float,
        state: RequestState,
    ):
        self.name = scorer.name
        self.scorer = scorer
        self.drafters = list(drafters)
        self.rule = rule
        self.leniency = leniency
        self.state = state
        self.counters = state.stats.tier(self.name)
        self.review_counters = state.stats.reviewer(self.name)

    def draft(self, ctx: Context, want: int, limit: int) -> Draft:
        # `want` is ignored: this reviewer's block size comes from its own K-matrix row (paper §3.3).
        # The block is capped at limit - 1 so that block + replacement/bonus never exceeds `limit`.
        cap = min(sum(quota for _, quota in self.drafters), limit - 1)
        block = Draft(dists=None if self.state.sampling.greedy else torch.zeros(0, self.state.vocab_size))
        goal = 0
        for drafter, quota in self.drafters:
            goal = min(goal + quota, cap)
            while len(block) < goal and not self._ends_in_eos(block):
                more = drafter.draft(ctx.extend(block.tokens), goal - len(block), cap - len(block))
                if not more:
                    break
                block = block + more
        probs = self.state.sampling.probs(_score(self.scorer, ctx.extend(block.tokens), len(block) + 1, self.counters))
        verdict = self.rule.review(block, probs, self.leniency, self.state.generator)
        self.review_counters.record(block.origins, verdict.accepted)
        tokens = block.tokens[: verdict.accepted] + [verdict.token]
        self.counters.tokens_out += len(tokens)
        return Draft(tokens, verdict.token_probs, verdict.dists, [self.name] * len(tokens))

    def _ends_in_eos(self, block: Draft) -> bool:
        return bool(block.tokens) and block.tokens[-1] in self.state.eos_ids


def _stack(rows: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    return torch.stack(rows) if rows else torch.zeros(0, vocab_size)


def build_cascade(
    target: Scorer,
    drafters: Sequence[Scorer | MaxGram],
    schedule: Schedule,
    leniency: float,
    state: RequestState,
) -> CascadeDrafter:
    """The target's system for one request: drafters largest first, wired by the K-matrix.

    Row r of the schedule belongs to reviewer T_r (T_0 the target, T_r the r-th drafter); a drafter
    whose row is all zeros, and the last drafter, draft alone. Each tier's system is built once and
    shared by every row that uses it, so one tier keeps one KV cache per request.
    """
    if leniency < 1.0:
        raise ValueError(f"leniency must be >= 1, got {leniency}")
    rule = rule_for(state.sampling.greedy)
    tiers: list[Scorer | MaxGram] = [target, *drafters]
    systems: dict[int, Drafter] = {}
    for r in range(len(tiers) - 1, -1, -1):  # bottom-up: a reviewer needs the systems below it
        tier = tiers[r]
        if isinstance(tier, MaxGram):
            systems[r] = MaGDrafter(tier, state)
        elif r > 0 and schedule.is_leaf(r):
            systems[r] = ModelDrafter(tier, state)
        else:
            row = [(systems[c + 1], quota) for c, quota in schedule.row(r)] if drafters else []
            # The target's review is always strict (Algorithm 1: "if isFirstCall then l <- 1").
            systems[r] = CascadeDrafter(tier, row, rule, 1.0 if r == 0 else leniency, state)
    return systems[0]  # type: ignore[return-value]
