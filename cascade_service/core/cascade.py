"""The recursive cascade (CS Drafting, Algorithm 1) built by composition.

A reviewer plus the drafters below it is itself a drafter (`CascadeDrafter`), so the vertical
cascade is nesting and the horizontal cascade is the ordered list of drafters inside one reviewer.
The target's system is the outermost `CascadeDrafter`, reviewing strictly; there is no second copy
of the recursion anywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from .adaptive import AdaptiveLength, DraftStopper, StopperFactory
from .load import DraftBudget, charged
from .mag import MaxGram
from .review import ReviewRule, Verdict, rule_for
from .sampling import SamplingParams, sample
from .schedule import Schedule
from .stats import CascadeStats, TierCounters
from .types import Context, Draft, Drafter, Scorer
from .verify import EXACT, Verification, final_rule


@dataclass(frozen=True)
class Lookup:
    """MaG-first drafting at the target (ours, not in the paper): the gate of a dynamic horizontal cascade.

    When the sequence's last `min_match` or more tokens occurred earlier, MaG's continuation of that
    occurrence (at most `tokens` of it) is the target's whole block and the model drafters rest; on
    no such match the K-matrix schedule runs as usual. Text that repeats itself (code, quoting, edits,
    a model stuck in a loop) is where a long n-gram match is right almost every time and a model
    drafter's forward passes are wasted; prompt-lookup decoding is this gate without the fallback.
    """

    min_match: int = 2
    tokens: int = 10

    def __post_init__(self) -> None:
        for name, value in (("min_match", self.min_match), ("tokens", self.tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 256:
                raise ValueError(f"lookup.{name} must be an integer in [1, 256], got {value!r}")


@dataclass
class RequestState:
    """What every drafter of one request shares."""

    sampling: SamplingParams
    generator: torch.Generator
    stats: CascadeStats
    vocab_size: int
    eos_ids: frozenset[int] = frozenset()
    verification: Verification = EXACT  # the final verifier's rule (core.verify)
    # Adaptive draft length per tier that drafts alone (core.adaptive): local tiers get a stopper
    # from `make_stopper`; remote ones get the spec and build their own, where the hidden states are.
    adaptive: dict[str, AdaptiveLength] = field(default_factory=dict)
    make_stopper: StopperFactory | None = None
    # Load-adaptive speculation (core.load): caps each round's block at the target from measured
    # acceptance and the current batch; None drafts as the K-matrix says.
    budget: DraftBudget | None = None


@runtime_checkable
class BlockTier(Protocol):
    """A model tier that drafts and reviews whole blocks where it lives, e.g. in another process.

    One call per block instead of one per token or per forward pass, and no full-vocabulary tensors
    cross unless sampling needs them (ARCHITECTURE invariant 5). `seed` seeds the tier's own RNG for
    this call; greedy calls ignore it. Each call adds its calls / tokens / time to `counters`.
    """

    name: str

    def draft_block(self, ctx: Context, k: int, sampling: SamplingParams, seed: int,
                    eos_ids: frozenset[int], counters: TierCounters, adaptive: AdaptiveLength | None = None) -> Draft:
        """`adaptive`: stop the block early by this rule (core.adaptive), run where the model is."""
        ...

    def review_block(self, ctx: Context, block: Draft, leniency: float, sampling: SamplingParams,
                     seed: int, counters: TierCounters, verification: Verification | None = None) -> Verdict:
        """`verification`: the final verifier's rule when this tier is the target (None: exact)."""
        ...


@runtime_checkable
class SystemTier(Protocol):
    """A drafter tier whose whole system (it reviewing the tiers below it) runs where it lives.

    One call per draft of that system instead of one per block of each tier in it; the counters of
    the tiers inside are added to `stats`.
    """

    name: str

    def system_draft(self, ctx: Context, want: int, limit: int, sampling: SamplingParams, seed: int,
                     eos_ids: frozenset[int], stats: CascadeStats,
                     adaptive: dict[str, AdaptiveLength] | None = None) -> Draft:
        """`adaptive`: the request's adaptive draft lengths, for the tiers inside this system."""
        ...


class SystemDrafter:
    """The cascade's view of a `SystemTier`: a drafter like any other."""

    def __init__(self, tier: SystemTier, state: RequestState):
        self.name = tier.name
        self.tier = tier
        self.state = state

    def draft(self, ctx: Context, want: int, limit: int) -> Draft:
        st = self.state
        seed = 0 if st.sampling.greedy else call_seed(st.generator)
        extra = {"adaptive": st.adaptive} if st.adaptive else {}
        return self.tier.system_draft(ctx, want, limit, st.sampling, seed, st.eos_ids, st.stats, **extra)


def draft_autoregressive(scorer: Scorer, ctx: Context, k: int, sampling: SamplingParams,
                         generator: torch.Generator, eos_ids: frozenset[int], vocab_size: int,
                         counters: TierCounters, stopper: DraftStopper | None = None) -> Draft:
    """Up to k tokens from `scorer` alone, one forward pass each; stops after an EOS, or earlier when
    `stopper` (adaptive draft length) says so."""
    tokens: list[int] = []
    token_probs: list[float] = []
    rows: list[torch.Tensor] = []
    needs_hidden = stopper is not None and stopper.needs_hidden
    if stopper is not None:
        stopper.start()
        scorer.keep_hidden = needs_hidden  # type: ignore[attr-defined]  # HFScorer's option
    for _ in range(k):
        probs = sampling.probs(_score(scorer, ctx.extend(tokens), 1, counters))[0]  # [V]
        token = int(probs.argmax()) if sampling.greedy else sample(probs, generator)
        tokens.append(token)
        token_probs.append(float(probs[token]))
        rows.append(probs)
        if token in eos_ids:  # nothing after EOS can be kept
            break
        # The hidden state of the pass that drafted this token sits at the previous token's position.
        hidden = scorer.last_hidden[-1] if needs_hidden else None  # type: ignore[attr-defined]
        if stopper is not None and len(tokens) < k and stopper.should_stop(token, probs, hidden):
            break
    dists = _stack(rows, vocab_size) if sampling.carries_rows else None
    return Draft(tokens, token_probs, dists, [scorer.name] * len(tokens))


def score_and_review(scorer: Scorer, ctx: Context, block: Draft, rule: ReviewRule, leniency: float,
                     sampling: SamplingParams, generator: torch.Generator, counters: TierCounters) -> Verdict:
    """Score context + block in ONE forward pass (k + 1 distributions) and review the block."""
    probs = sampling.probs(_score(scorer, ctx.extend(block.tokens), len(block) + 1, counters))
    return rule.review(block.for_reviewer(probs), probs, leniency, generator)  # the drafts' rows move here only


def call_seed(generator: torch.Generator) -> int:
    """A seed for a BlockTier call, drawn from the request's RNG so a request stays reproducible."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


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
        self.adaptive = state.adaptive.get(self.name)
        # A BlockTier runs its stopper where it lives, beside the hidden states (it gets the spec).
        self.stopper = None if isinstance(scorer, BlockTier) else _local_stopper(self.name, self.adaptive, state)

    def draft(self, ctx: Context, want: int, limit: int) -> Draft:
        st = self.state
        if isinstance(self.scorer, BlockTier):
            seed = 0 if st.sampling.greedy else call_seed(st.generator)
            extra = {"adaptive": self.adaptive} if self.adaptive else {}
            draft = self.scorer.draft_block(ctx, min(want, limit), st.sampling, seed, st.eos_ids, self.counters,
                                            **extra)
        else:
            draft = draft_autoregressive(self.scorer, ctx, min(want, limit), st.sampling, st.generator,
                                         st.eos_ids, st.vocab_size, self.counters, self.stopper)
        self.counters.tokens_out += len(draft)
        return draft


class MaGDrafter:
    """Max-Gram proposals as a drafter: a point mass on each proposed token (Algorithm 1, base case).

    The lookup gate's use of MaG (`Lookup`) is counted apart, as tier `mag_lookup`, so the stats show
    whether MaG drafted inside the K-matrix or only through the gate.
    """

    name = "mag"
    lookup_name = "mag_lookup"

    def __init__(self, mag: MaxGram, state: RequestState):
        self.mag = mag
        self.state = state
        state.stats.tier(self.name)  # listed even if the schedule never calls it: the stats show that

    def draft(self, ctx: Context, want: int, limit: int) -> Draft:
        return self._timed(self.name, lambda: self.mag.propose(ctx, min(want, limit)))

    def lookup(self, ctx: Context, k: int, min_match: int) -> Draft:
        """Only MaG's n-gram continuation, when its match is at least `min_match` long (see `Lookup`)."""
        return self._timed(self.lookup_name, lambda: self.mag.lookup(ctx, k, min_match))

    def _timed(self, name: str, propose: Callable[[], list[int]]) -> Draft:
        counters = self.state.stats.tier(name)
        start = time.perf_counter()
        tokens = propose()
        counters.time_s += time.perf_counter() - start
        counters.calls += 1
        counters.tokens_out += len(tokens)
        dists = None
        if self.state.sampling.carries_rows:
            dists = torch.zeros(len(tokens), self.state.vocab_size)
            dists[torch.arange(len(tokens)), tokens] = 1.0
        return Draft(tokens, [1.0] * len(tokens), dists, [name] * len(tokens))


def _local_stopper(name: str, spec: AdaptiveLength | None, state: RequestState) -> DraftStopper | None:
    """The request's stopper for tier `name`, where the tier's model runs in this process."""
    if spec is None:
        return None
    if state.make_stopper is None:
        raise ValueError(f"adaptive draft length for {name!r} needs a stopper factory in this wiring")
    return state.make_stopper(spec)


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
        self.lookup: tuple[MaGDrafter, Lookup] | None = None  # set by build_cascade on the target only
        self.rule = rule
        self.leniency = leniency
        self.state = state
        self.final = False  # the target's review: build_cascade sets it; it applies the request's rule
        self.counters = state.stats.tier(self.name)
        self.review_counters = state.stats.reviewer(self.name)
        # SpecDec++ at a reviewing tier (an inner one: the target never drafts): see `draft`.
        self.adaptive = state.adaptive.get(self.name)
        self.stopper: DraftStopper | None = None
        if self.adaptive is not None:
            if isinstance(scorer, BlockTier):
                raise ValueError(f"adaptive draft length for reviewing tier {self.name!r} needs its model in this "
                                 "process (or its whole sub-cascade in its replica)")
            self.stopper = _local_stopper(self.name, self.adaptive, state)
            scorer.keep_hidden = True  # type: ignore[attr-defined]  # HFScorer's option

    def draft(self, ctx: Context, want: int, limit: int) -> Draft:
        """One review round; with a stopper, rounds until `want` tokens or the stopper ends the part.

        SpecDec++ at a reviewing tier (ours; the paper stops an autoregressive drafter): the tier's
        emitted tokens are its candidates for the level above, and its review pass computed the hidden
        state at each of them, so the acceptance head prices them exactly as it prices a lone
        drafter's tokens (core.adaptive.SpecDecPPStopper: token i is judged on the hidden state of
        token i - 1). The part ends at the token where the predicted chance of a rejection passes h;
        the tokens after it in that round are dropped, as a lone drafter would not have drafted them.
        """
        if self.stopper is None:
            return self._round(ctx, limit)
        self.stopper.start()
        part = self._empty()
        while len(part) < min(want, limit) and not self._ends_in_eos(part):
            piece = self._round(ctx.extend(part.tokens), limit - len(part))
            hidden = self.scorer.last_hidden  # type: ignore[attr-defined]  # [k + 1, H], row j: before piece[j]
            for j, token in enumerate(piece.tokens):
                if self.stopper.should_stop(token, None, hidden[j]):
                    return part + piece.head(j + 1)
            part = part + piece
        return part

    def _empty(self) -> Draft:
        return Draft(dists=torch.zeros(0, self.state.vocab_size) if self.state.sampling.carries_rows else None)

    def _round(self, ctx: Context, limit: int) -> Draft:
        # `want` is ignored: this reviewer's block size comes from its own K-matrix row (paper §3.3),
        # whatever its parent still needs, so every K-matrix entry runs (docs/algorithm.md, "How a
        # K-matrix runs"). The only hard bound is `limit`: block + replacement/bonus never exceeds it,
        # so a drafter below may overshoot its quota up to `ceiling` and the extra tokens are kept, as
        # in the authors' csd.py. Load adaptation (the target only) lowers the ceiling further.
        ceiling = limit - 1
        budget = self.state.budget if self.final else None
        block = self._empty()
        if budget is not None:
            budget.begin()  # the round's time runs from here: the lookup and the drafting are part of it
            compute = charged()
        looked_up = False
        if self.lookup is not None and limit > 1:
            mag, gate = self.lookup
            block = block + mag.lookup(ctx, min(gate.tokens, limit - 1), gate.min_match)
            looked_up = bool(block)
            if looked_up and budget is not None:  # the lookup is already spent: the budget only trims it
                block = block.head(budget("lookup", len(block)))
        if not looked_up and budget is not None and ceiling > 0:
            ceiling = budget("model", min(sum(quota for _, quota in self.drafters), ceiling))
        goal = 0
        for drafter, quota in self.drafters if not looked_up else ():
            goal = min(goal + quota, ceiling)
            while len(block) < goal and not self._ends_in_eos(block):
                asked = goal - len(block)
                more = drafter.draft(ctx.extend(block.tokens), asked, ceiling - len(block))
                if not more:
                    break
                block = block + more
                if len(more) < asked and getattr(drafter, "adaptive", None) is not None:
                    break  # its stopping rule ended its part of the block: the next drafter takes over
        # Drafting's cost: this request's share of the drafters' batched passes and its thread's own CPU
        # (core.load.charged). Remote drafters' work is not in it: load adaptation is for in-process tiers.
        drafting_s = charged() - compute if budget is not None else 0.0
        st = self.state
        if isinstance(self.scorer, BlockTier):
            seed = 0 if st.sampling.greedy else call_seed(st.generator)
            verify = st.verification if self.final and st.verification.rule != "exact" else None
            verdict = self.scorer.review_block(ctx, block, self.leniency, st.sampling, seed, self.counters,
                                               **({"verification": verify} if verify else {}))
        else:
            verdict = score_and_review(self.scorer, ctx, block, self.rule, self.leniency, st.sampling,
                                       st.generator, self.counters)
        self.review_counters.record(block.origins, verdict.accepted)
        if budget is not None:
            budget.observe(len(block), verdict.accepted, drafting_s)
        if self.final:
            st.stats.off_target_tokens += verdict.off_target
            st.stats.tv_deviation += verdict.tv
            st.stats.loglik_loss += verdict.ll_loss
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
    lookup: Lookup | None = None,
    strict_top: bool = True,
) -> CascadeDrafter:
    """The target's system for one request: drafters largest first, wired by the K-matrix.

    Row r of the schedule belongs to reviewer T_r (T_0 the target, T_r the r-th drafter); a drafter
    whose row is all zeros, and the last drafter, draft alone. Each tier's system is built once and
    shared by every row that uses it, so one tier keeps one KV cache per request. `lookup` gates MaG
    in front of the target's row (it needs MaG among the drafters). `strict_top=False` builds an
    inner tier's system (reviewing with `leniency`), e.g. a sub-cascade run inside a tier's replica.
    A drafter given as a `SystemTier` stands for its whole system.
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
        elif r > 0 and isinstance(tier, SystemTier):
            systems[r] = SystemDrafter(tier, state)
        elif r > 0 and schedule.is_leaf(r):
            systems[r] = ModelDrafter(tier, state)
        else:
            row = [(systems[c + 1], quota) for c, quota in schedule.row(r)] if drafters else []
            # The target's review is always strict (Algorithm 1: "if isFirstCall then l <- 1"); a lossy
            # final rule, if the request asked for one, is the only exception (core.verify).
            final = r == 0 and strict_top
            own = final_rule(state.sampling.greedy, state.verification) if final else rule
            systems[r] = CascadeDrafter(tier, row, own, 1.0 if final else leniency, state)
            systems[r].final = final
    top: CascadeDrafter = systems[0]  # type: ignore[assignment]
    if lookup is not None:
        mags = [s for s in systems.values() if isinstance(s, MaGDrafter)]
        if not mags or not drafters:
            raise ValueError("lookup needs the MaG drafter among the drafters")
        top.lookup = (mags[0], lookup)
        state.stats.tier(MaGDrafter.lookup_name)
    return top
