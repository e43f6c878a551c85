"""Tiers that run in this process: a model (`ModelTier`) and a statistical drafter (`StatisticalTier`:
MaG or suffix decoding).

Both are one request's view (a model tier owns the request's KV cache through its `Scorer`; MaG its
n-gram index) and implement `core.tier.Tier`. A tier replica serves remote calls with these same
classes, so a tier does the same work wherever the coordinator is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch

from .adaptive import AdaptiveLength, DraftStopper, StopperFactory
from .grammar import GrammarMask, GrammarSpec
from .placement import host_at, host_reads, request_generator
from .review import NO_DRAWS, GreedyReview, KeyedReview, ReviewRule, Verdict, token_logprobs
from .sampling import SamplingParams, race, sample
from .stats import TierCounters, Usage
from .tier import DraftReply, DraftRequest, Release, ReviewReply, ReviewRequest, Tier
from .types import Context, Draft, Scorer
from .verify import final_rule


def seeded(seed: int) -> torch.Generator:
    """The generator of one tier call (its draws move to the sampled tensor's device: core.placement)."""
    return request_generator(seed)


def _generator(sampling: SamplingParams, seed: int, keyed: bool, rule: ReviewRule | None = None) -> torch.Generator:
    """A call's generator; greedy drafting, keyed draws and a review that draws nothing share
    `review.NO_DRAWS`."""
    if keyed or (sampling.greedy and (rule is None or not rule.draws)):
        return NO_DRAWS
    return seeded(seed)


class ModelTier:
    """A language model in this process, for one request: drafts one token per forward pass, reviews a
    block in one pass. `make_stopper` builds the stopper of an adaptive draft length (None: this
    wiring has no acceptance heads, and asking for one fails naming the tier)."""

    system = False

    def __init__(
        self,
        scorer: Scorer,
        vocab_size: int,
        make_stopper: StopperFactory | None = None,
        follow: Callable[[GrammarSpec, Context], GrammarMask | None] | None = None,
    ):
        self.name = scorer.name
        self.scorer = scorer
        self.vocab_size = vocab_size
        self.make_stopper = make_stopper
        # A tier server's: the request's grammar state here, from the spec a call carries (None: unmasked)
        self.follow = follow
        self._stoppers: dict[AdaptiveLength, DraftStopper] = {}

    def draft(self, request: DraftRequest) -> DraftReply:
        usage = Usage()
        counters = usage.tier(self.name)
        stopper = self._stopper(request.adaptive.get(self.name))
        before, cached = self.scorer.tokens_processed, _cached(self.scorer)
        draft = draft_autoregressive(
            self.scorer,
            request.context,
            request.k,
            request.sampling,
            _generator(request.sampling, request.seed, request.keyed),
            request.eos_ids,
            self.vocab_size,
            counters,
            stopper,
            self._grammar(request),
            request.seed if request.keyed else None,
        )
        counters.tokens_processed = self.scorer.tokens_processed - before
        counters.tokens_cached = _cached(self.scorer) - cached
        counters.tokens_out = len(draft)
        return DraftReply(draft, usage, stopped=stopper is not None and len(draft) < request.want)

    def _grammar(self, request: DraftRequest) -> GrammarMask | None:
        grammar = request.grammar
        if isinstance(grammar, GrammarSpec):
            return self.follow(grammar, request.context) if self.follow is not None else None
        return grammar

    def review(self, request: ReviewRequest) -> ReviewReply:
        usage = Usage()
        counters = usage.tier(self.name)
        if request.hidden:
            self.scorer.keep_hidden = True  # type: ignore[attr-defined]  # HFScorer's option
        rule = (
            KeyedReview(request.seed, len(request.context))
            if request.keyed and not request.sampling.greedy
            else final_rule(request.sampling.greedy, request.verification)
        )
        before, cached = self.scorer.tokens_processed, _cached(self.scorer)
        verdict = score_and_review(
            self.scorer,
            request.context,
            request.block,
            rule,
            request.leniency,
            request.sampling,
            _generator(request.sampling, request.seed, request.keyed, rule),
            counters,
            request.logprobs,
            request.allowed,
            request.probs_unread,
        )
        counters.tokens_processed = self.scorer.tokens_processed - before
        counters.tokens_cached = _cached(self.scorer) - cached
        hidden = self.scorer.last_hidden if request.hidden else None  # type: ignore[attr-defined]
        return ReviewReply(verdict, usage, hidden)

    def release(self, request: Release) -> None:
        """The KV cache goes with this object (one per request); what it holds of the request's
        final sequence stays in the prefix cache."""
        finish = getattr(self.scorer, "finish", None)
        if finish is not None and request.tokens:
            finish(request.tokens)

    def _stopper(self, spec: AdaptiveLength | None) -> DraftStopper | None:
        if spec is None:
            return None
        if spec not in self._stoppers:
            if self.make_stopper is None:
                raise ValueError(f"adaptive draft length for {self.name!r} needs a stopper factory in this wiring")
            self._stoppers[spec] = self.make_stopper(spec)
        return self._stoppers[spec]


@runtime_checkable
class Proposer(Protocol):
    """A statistical drafter's per-request state (core.proposers): MaG (mag.MaxGram), suffix decoding
    (suffix.SuffixDecoder), a predicted output (prediction.PredictionProposer). Checkable at run time:
    whatever proposes is a statistical tier, whichever kind it is."""

    def propose(self, ctx: Context, k: int) -> list[int]: ...

    def lookup(self, ctx: Context, k: int, min_match: int) -> list[int]: ...

    def finish(self, tokens: Sequence[int] = ()) -> None: ...

    # True: a draft shorter than asked is the drafter's own decision (suffix decoding's confidence and
    # length rules), so the cascade does not ask it again for the rest of the quota.
    decides_length: bool


class StatisticalTier:
    """A statistical drafter (MaG, suffix decoding) as a tier, named after its config: a point mass on
    each proposed token (Algorithm 1, base case).

    A request with `min_match` (the lookup gate, `core.schedule.Lookup`) is counted apart, as tier
    `<name>_lookup` (`mag_lookup`), so the stats show whether the drafter drafted inside the K-matrix
    or only through the gate.
    """

    system = False

    def __init__(self, proposer: Proposer, vocab_size: int, name: str = "mag"):
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.name = name
        self.lookup_name = f"{name}_lookup"

    def draft(self, request: DraftRequest) -> DraftReply:
        ctx, k = request.context, request.k
        if request.min_match:
            reply = self._timed(
                self.lookup_name, request.sampling, lambda: self.proposer.lookup(ctx, k, request.min_match)
            )
        else:
            reply = self._timed(self.name, request.sampling, lambda: self.proposer.propose(ctx, k))
        if self.proposer.decides_length and len(reply.draft) < k:
            return replace(reply, stopped=True)
        return reply

    def review(self, request: ReviewRequest) -> ReviewReply:
        raise TypeError(f"{self.name} drafts but cannot review: no schedule gives it a row of its own")

    def release(self, request: Release) -> None:
        """The request is over: suffix decoding keeps its sequence for its key's later requests, MaG
        its index of the final tokens for a request that continues them (engine.leaves)."""
        self.proposer.finish(request.tokens)

    def _timed(self, name: str, sampling: SamplingParams, propose: Callable[[], list[int]]) -> DraftReply:
        usage = Usage()
        counters = usage.tier(name)
        start = time.perf_counter()
        tokens = propose()
        counters.time_s += time.perf_counter() - start
        counters.calls += 1
        counters.tokens_out += len(tokens)
        return DraftReply(Draft.point(tokens, self.vocab_size, sampling.carries_rows, name), usage)


def draft_autoregressive(
    scorer: Scorer,
    ctx: Context,
    k: int,
    sampling: SamplingParams,
    generator: torch.Generator,
    eos_ids: frozenset[int],
    vocab_size: int,
    counters: TierCounters,
    stopper: DraftStopper | None = None,
    grammar: GrammarMask | None = None,
    keyed_seed: int | None = None,
) -> Draft:
    """Up to k tokens from `scorer` alone, one forward pass each; stops after an EOS, or earlier when
    `stopper` (adaptive draft length) says so. Under a `grammar` each step's distribution is masked to
    what it allows (the rows are the masked distributions: what the tokens were drawn from); drafting
    stops where nothing is allowed, or where the context already holds a draft it refuses. With a
    `keyed_seed` a sampled token is the race winner under the request's noise at its position (the
    token the target draws there when their races agree: core.sampling `race`), else a draw from
    `generator`."""
    if k > 1 and stopper is None and grammar is None and chainable(sampling) and getattr(scorer, "chains", False):
        return _draft_chained(scorer, ctx, k, eos_ids, counters)
    tokens: list[int] = []
    token_probs: list[float] = []
    rows: list[torch.Tensor] = []
    needs_hidden = stopper is not None and stopper.needs_hidden
    if stopper is not None:
        stopper.start()
        scorer.keep_hidden = needs_hidden  # type: ignore[attr-defined]  # HFScorer's option
    for _ in range(k):
        scored = ctx.extend(tokens)
        allowed = None
        if grammar is not None:
            mask = grammar.mask(scored.tokens)
            if mask is None or not bool(mask.any()):
                break
            allowed = mask[None]
        row = sampling.probs(_score(scorer, scored, 1, counters), scored.tokens, allowed)  # [1, V]
        probs = row[0]
        # Reads go through numpy's view on the CPU (core.placement): after a pass every torch op runs
        # cold, so the token and its probability take none.
        if sampling.greedy:
            best, p_best, _ = host_reads(row, [])
            token, p_token = best[0], p_best[0]
        else:
            token = sample(probs, generator) if keyed_seed is None else race(row, keyed_seed, len(scored))[0]
            p_token = host_at(row, [token])[0]
        tokens.append(token)
        token_probs.append(p_token)
        rows.append(probs)
        if token in eos_ids:  # nothing after EOS can be kept
            break
        # The hidden state of the pass that drafted this token sits at the previous token's position.
        hidden = scorer.last_hidden[-1] if needs_hidden else None  # type: ignore[attr-defined]
        if stopper is not None and len(tokens) < k and stopper.should_stop(token, probs, hidden):
            break
    dists = (torch.stack(rows) if rows else torch.zeros(0, vocab_size)) if sampling.carries_rows else None
    return Draft(tokens, token_probs, dists, [scorer.name] * len(tokens))


def chainable(sampling: SamplingParams) -> bool:
    """Whether a draft under `sampling` may run its steps chained on the device (models.chain): plain
    greedy, each step's token the argmax of the model's own softmax, nothing the host must add."""
    return sampling.greedy and not sampling.carries_rows and not sampling.logit_bias and not sampling.penalized


def _draft_chained(scorer: Scorer, ctx: Context, k: int, eos_ids: frozenset[int], counters: TierCounters) -> Draft:
    """draft_autoregressive's greedy draft as one chained run (HFScorer.draft_greedy): the same tokens,
    one read back to the host instead of one per token; cut after an EOS, as the loop would stop."""
    start = time.perf_counter()
    tokens, probs = scorer.draft_greedy(ctx, k)  # type: ignore[attr-defined]  # HFScorer's, where `chains`
    counters.time_s += time.perf_counter() - start
    counters.calls += k
    end = next((i + 1 for i, token in enumerate(tokens) if token in eos_ids), len(tokens))
    return Draft(tokens[:end], probs[:end], None, [scorer.name] * end)


def score_and_review(
    scorer: Scorer,
    ctx: Context,
    block: Draft,
    rule: ReviewRule,
    leniency: float,
    sampling: SamplingParams,
    generator: torch.Generator,
    counters: TierCounters,
    logprobs: int = -1,
    allowed: torch.Tensor | None = None,
    probs_unread: bool = False,
) -> Verdict:
    """Score context + block in ONE forward pass (k + 1 distributions) and review the block; with
    `logprobs` >= 0, the emitted tokens' log-probabilities under these distributions, and as many
    alternatives each. A greedy review with no logprobs and no draft rows decides on the logits
    (`GreedyReview.decide`), computing only the probabilities read: none with `probs_unread`
    (ReviewRequest's) but a lenient check's rows."""
    scored = ctx.extend(block.tokens)
    logits = _score(scorer, scored, len(block) + 1, counters)
    if isinstance(rule, GreedyReview) and logprobs < 0 and block.dists is None:
        return rule.decide(block, sampling.scores(logits, scored.tokens, allowed), leniency, probs_unread)
    probs = sampling.probs(logits, scored.tokens, allowed)
    verdict = rule.review(block.for_reviewer(probs), probs, leniency, generator)  # the drafts' rows move here only
    if logprobs < 0:
        return verdict
    emitted = [*block.tokens[: verdict.accepted], verdict.token]
    return replace(verdict, logprobs=token_logprobs(probs, emitted, logprobs))


def _score(scorer: Scorer, ctx: Context, n: int, counters: TierCounters) -> torch.Tensor:
    start = time.perf_counter()
    logits = scorer.logits(ctx, n)
    counters.time_s += time.perf_counter() - start
    counters.calls += 1
    return logits


def local_tiers(
    vocab_size: int, target: Scorer, drafters: Sequence[Scorer | Proposer], make_stopper: StopperFactory | None = None
) -> tuple[ModelTier, list[Tier]]:
    """The tiers of one request whose models and statistical drafters all run in this process:
    (target, drafters). A drafter that proposes (`Proposer`: any statistical kind) is a statistical
    tier, a scorer a model tier."""

    def tier(t: Scorer | Proposer) -> Tier:
        if isinstance(t, Proposer):
            return StatisticalTier(t, vocab_size)
        return ModelTier(t, vocab_size, make_stopper)

    return ModelTier(target, vocab_size, make_stopper), [tier(d) for d in drafters]


def _cached(scorer: Scorer) -> int:
    """Positions a scorer's prefix cache gave it so far (0 for a scorer without one)."""
    return int(getattr(scorer, "tokens_cached", 0))
