"""The recursive cascade (CS Drafting, Algorithm 1) built by composition.

A reviewer plus the drafters below it is itself a tier (`CascadeTier`), so the vertical cascade is nesting and the
horizontal cascade is the ordered list of drafters inside one reviewer. The target's system is the outermost
`CascadeTier`, reviewing strictly; there is no second copy of the recursion anywhere. Every tier is reached through
`core.tier.Tier`, whether it runs here or in another process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .adaptive import AdaptiveLength, DraftStopper, StopperFactory
from .grammar import GrammarMask
from .policy import FIXED, BlockPolicy
from .proposers.prediction import MAX_BLOCK as PREDICTION_BLOCK
from .sampling import SamplingParams
from .schedule import FILLS, Fill, Lookup, Schedule
from .stats import CascadeStats, Usage, absorb
from .tier import DraftReply, DraftRequest, Release, ReviewReply, ReviewRequest, Tier, call_seed
from .types import Context, Draft
from .verify import EXACT, Verification

__all__ = ["CascadeTier", "Lookup", "RequestState", "build_cascade"]  # Lookup lives in core.schedule


@dataclass
class RequestState:
    """What every tier of one request shares."""

    sampling: SamplingParams
    generator: torch.Generator  # seeds every tier call of the request (core.tier.call_seed)
    stats: CascadeStats
    vocab_size: int
    eos_ids: frozenset[int] = frozenset()
    verification: Verification = EXACT  # the final verifier's rule (core.verify)
    # Adaptive draft length by tier (core.adaptive): a tier drafting alone applies its own where its
    # model is; a reviewing tier's stopper is built here by `make_stopper`.
    adaptive: dict[str, AdaptiveLength] = field(default_factory=dict)
    make_stopper: StopperFactory | None = None
    # The target's block policy (core.policy): the K-matrix as configured, or load adaptation.
    policy: BlockPolicy = FIXED
    request_id: str = ""
    cache_salt: str = ""  # its API key's prefix-cache scope (models.kvpool), sent with every call
    # The request's predicted output as a drafter (core.proposers.prediction, a StatisticalTier named
    # "prediction"): it drafts at the target before the lookup gate and the K-matrix.
    prediction: Tier | None = None
    logprobs: int = -1  # >= 0: the target's review reports each emitted token's logprob, this many alternatives
    grammar: GrammarMask | None = None  # the request's response format at the target's review (core.grammar)
    # A lossless sampled request draws by position (core.sampling `race`): every tier call carries
    # `seed`, the request's own, and `keyed`; otherwise each call's seed comes from `generator`.
    seed: int = 0
    keyed: bool = False

    def request(self, context: Context, want: int, limit: int) -> DraftRequest:
        """The request's draft request for the target's system."""
        return DraftRequest(
            self.request_id,
            context,
            want,
            limit,
            self.sampling,
            0,
            self.eos_ids,
            self.adaptive,
            cache_salt=self.cache_salt,
            keyed=self.keyed,
        )

    def tier_seed(self) -> int:
        """The seed of one tier call: 0 when greedy (nothing is drawn), the request's own when its draws
        are keyed by position, else a fresh one from the request's generator."""
        if self.sampling.greedy:
            return 0
        return self.seed if self.keyed else call_seed(self.generator)


class CascadeTier:
    """A reviewer over drafters: fills a block by its K-matrix row, reviews it in one forward pass.

    Steps (Algorithm 1):
    1. Horizontal cascade: each drafter in order adds its K-matrix entry to the block (`fill`:
       core.schedule, "entry" by default; the authors' running total under "total"); a drafter that
       returns nothing hands over to the next one.
    2. Score context + block in ONE forward pass: k + 1 next-token distributions.
    3. Review left to right (leniency l at inner reviews, 1 at the final one); emit the kept drafts
       plus the replacement or bonus token, with their true proposal distributions for the level above.
    """

    system = True

    def __init__(
        self,
        reviewer: Tier,
        drafters: Sequence[tuple[Tier, int]],
        leniency: float,
        state: RequestState,
        final: bool = False,
        stopper: DraftStopper | None = None,
        fill: Fill = FILLS["entry"],
    ):
        self.name = reviewer.name
        self.reviewer = reviewer
        self.drafters = list(drafters)
        self.fill = fill
        self.leniency = leniency
        self.state = state
        self.final = final  # the target's review: it applies the request's rule and its block policy
        self.policy = state.policy if final else FIXED
        # No reviewer above reads this tier's verdict probabilities: the target's (there is none), and an
        # inner tier's whose every reviewer is strict (build_cascade): its review then computes none.
        self.unread = final
        self.lookup: tuple[Tier, Lookup] | None = None  # set by build_cascade on the target only
        self.stopper = stopper  # SpecDec++ at a reviewing tier (an inner one: the target never drafts): `draft`
        # One empty block serves every round that opens empty (drafts are never changed in place); the row's
        # drafters' names, for a round none of them may draft in.
        self._none = self._empty()
        self._drafter_names = tuple(drafter.name for drafter, _ in self.drafters)

    def draft(self, request: DraftRequest) -> DraftReply:
        """One review round; with a stopper, rounds until `want` tokens or the stopper ends the part.

        SpecDec++ at a reviewing tier (ours; the paper stops an autoregressive drafter): the tier's emitted tokens
        are its candidates for the level above, and its review pass computed the hidden state at each of them, so
        the acceptance head prices them exactly as it prices a lone drafter's tokens
        (core.adaptive.SpecDecPPStopper: token i is judged on the hidden state of token i - 1). The part ends at the
        token where the predicted chance of a rejection passes h; the tokens after it in that round are dropped, as
        a lone drafter would not have drafted them.
        """
        usage = Usage()
        if self.stopper is None:
            return DraftReply(self._round(request, request.context, request.limit, usage)[0], usage)
        self.stopper.start()
        part = self._none
        while len(part) < request.k and not self._ends_in_eos(part):
            piece, hidden = self._round(request, request.context.extend(part.tokens), request.limit - len(part), usage)
            assert hidden is not None  # asked for: [k + 1, H], row j before piece[j]
            for j, token in enumerate(piece.tokens):
                if self.stopper.should_stop(token, None, hidden[j]):
                    return DraftReply(part + piece.head(j + 1), usage, stopped=True)
            part = part + piece
        return DraftReply(part, usage, stopped=len(part) < request.want)

    def reads_drafts(self) -> bool:
        """Whether its review reads its drafts' probabilities: lenient, sampling (or rows), or a lossy rule."""
        st = self.state
        return self.leniency > 1.0 or st.sampling.carries_rows or (self.final and st.verification != EXACT)

    def review(self, request: ReviewRequest) -> ReviewReply:
        """A system reviews as its reviewing tier does."""
        return self.reviewer.review(request)

    def release(self, request: Release) -> None:
        self.reviewer.release(request)
        for drafter, _ in self.drafters:
            drafter.release(request)

    def _gates(self) -> list[tuple[Tier, int, int, bool]]:
        """(drafter, tokens wanted, min_match, whether the block policy rules on it) that may fill a block
        before the K-matrix row runs. The request's own prediction is not the policy's to refuse or trim:
        the client sent it to be verified (OpenAI's predicted outputs). The lookup gate is, as source "lookup"."""
        gates: list[tuple[Tier, int, int, bool]] = []
        if self.final and self.state.prediction is not None:
            gates.append((self.state.prediction, PREDICTION_BLOCK, 0, False))  # the proposer sizes its own blocks
        if self.lookup is not None:
            mag, gate = self.lookup
            gates.append((mag, gate.tokens, gate.min_match, True))
        return gates

    def _forced(self, ctx: Context, ceiling: int) -> Draft:
        """The block's opening: at the target, the tokens the request's grammar forces next (core.grammar),
        whose state stands at the end of `ctx` (the committed sequence) for every tier of this round."""
        st = self.state
        if not self.final or st.grammar is None:
            return self._none
        st.grammar.anchor(len(ctx))
        return Draft.point(st.grammar.forced(ceiling), st.vocab_size, st.sampling.carries_rows, "grammar")

    def _empty(self) -> Draft:
        return Draft(dists=torch.zeros(0, self.state.vocab_size) if self.state.sampling.carries_rows else None)

    def _ask(self, request: DraftRequest, ctx: Context, want: int, limit: int, min_match: int = 0) -> DraftRequest:
        st = self.state  # a drafter in this process masks with the request's grammar (core.grammar)
        return request.asking(ctx, want, limit, st.tier_seed(), min_match, st.grammar, st.keyed)

    def _round(
        self, request: DraftRequest, ctx: Context, limit: int, usage: Usage
    ) -> tuple[Draft, torch.Tensor | None]:
        # `want` is ignored: this reviewer's block size comes from its own K-matrix row (paper §3.4),
        # whatever its parent still needs (docs/algorithm.md, "How a K-matrix runs"). The only hard
        # bound is `limit`: block + replacement/bonus never exceeds it, so a drafter below may
        # overshoot its quota up to `ceiling` and the extra tokens are kept, as in the authors'
        # csd.py. The block policy (the target's) may lower the ceiling further.
        ceiling = limit - 1
        policy = self.policy
        policy.begin(len(ctx), limit)  # the round's time runs from here: the lookup and the drafting are in it
        block, ran, ended, gated = self._block(request, ctx, ceiling, usage)
        st = self.state
        allowed = None
        if st.grammar is not None:
            block, allowed = self._masked(ctx, block)
        review = self.reviewer.review(
            ReviewRequest(
                request.request_id,
                ctx,
                block,
                self.leniency,
                st.sampling,
                st.tier_seed(),
                st.verification if self.final else EXACT,
                hidden=self.stopper is not None,
                cache_salt=request.cache_salt,
                logprobs=st.logprobs if self.final else -1,
                allowed=allowed,
                keyed=st.keyed,
                probs_unread=self.unread,
            )
        )
        absorb(usage, review.usage)
        verdict = review.verdict
        usage.reviewer(self.name).record(block.origins, verdict.accepted, ran, ended, gated)
        policy.observe(len(block), verdict.accepted)
        if self.final:
            usage.off_target += verdict.off_target
            usage.tv += verdict.tv
            usage.ll_loss += verdict.ll_loss
        tokens = block.tokens[: verdict.accepted] + [verdict.token]
        if self.final and st.grammar is not None:
            st.grammar.advance(tokens)
        if self.final and st.logprobs >= 0:
            st.stats.logprobs.extend(verdict.logprobs)  # one per emitted token; decode trims the unused
        usage.tier(self.name).tokens_out += len(tokens)
        return Draft(tokens, verdict.token_probs, verdict.dists, [self.name] * len(tokens)), review.hidden

    def _block(
        self, request: DraftRequest, ctx: Context, ceiling: int, usage: Usage
    ) -> tuple[Draft, list[str], list[str], bool]:
        """The round's block (gates first, then the K-matrix row: `_fill`), the row's drafters called and
        those whose turn came after the block had ended, and whether a gate filled it."""
        policy = self.policy
        if self._drafts_nothing(policy, ceiling):
            # A round the policy keeps plain (most rounds at T = 1; every round of a request the floor
            # rests): the block is empty and no drafter's turn comes, as the full path below finds at
            # more cost, without calling `drafted` (no drafting to time).
            return self._none, [], list(self._drafter_names), False
        block = self._forced(ctx, ceiling)
        gated = False
        # The prediction first (the target's only), then the lookup gate: a block either fills it alone.
        for source, want, min_match, ruled in self._gates():
            if gated or len(block) >= ceiling:
                break
            if ruled and not policy.allows("lookup"):
                continue
            held = len(block)
            asked = self._ask(request, ctx.extend(block.tokens), want, ceiling - held, min_match)
            reply = source.draft(asked)
            absorb(usage, reply.usage)
            block = block + reply.draft
            gated = len(block) > held
            if gated and ruled:  # the lookup is already spent: the policy only trims it
                block = block.head(policy.cap("lookup", len(block), len(block)))
        ran: list[str] = []  # the row's drafters called in this block
        ended: list[str] = []  # those whose turn came after the block had ended (budget, cap or EOS)
        if not gated:
            if len(block) < ceiling:
                model = policy.allows("model")
                ceiling = policy.cap("model", sum(quota for _, quota in self.drafters), ceiling) if model else 0
            block = self._fill(request, ctx, block, ceiling, usage, ran, ended)
        policy.drafted()
        return block, ran, ended, gated

    def _drafts_nothing(self, policy: BlockPolicy, ceiling: int) -> bool:
        """Whether this round's block is sure to be empty: no forced tokens or prediction, and no room for
        a draft (the request's last token: the full path asks the policy nothing then) or the policy lets
        no gate nor the row draft (asked as the full path asks: the lookup only where there is one)."""
        if self.final and (self.state.grammar is not None or self.state.prediction is not None):
            return False
        if ceiling < 1:
            return True
        return (self.lookup is None or not policy.allows("lookup")) and not policy.allows("model")

    def _masked(self, ctx: Context, block: Draft) -> tuple[Draft, torch.Tensor | None]:
        """The block for a review under the request's grammar, and each review position's mask (core.grammar).

        The block ends at its first draft the grammar refuses. That draft stays where the review must
        reject it: sampled under the exact rule, its masked probability is 0, so the target rejects it and samples the
        residual max(0, p - q); dropping it instead would sample p where the residual was due and bias the output. An
        inner review rejects it the same way, leniency or not, and its rows stay the true distributions of what it
        emits. Greedy at the target, or under a lossy rule (which might keep it), it goes. Its bonus position is never
        reached, and takes the last mask so the rows stay [k + 1, V]. An inner tier whose context already holds a
        refused draft reviews unmasked: the target's review ends the block there."""
        st = self.state
        assert st.grammar is not None
        masked = st.grammar.masks(ctx.tokens, block.tokens)
        if masked is None:
            return block, None
        valid, allowed = masked
        if valid == len(block):
            return block, allowed
        if not self.final or (not st.sampling.greedy and st.verification == EXACT):
            return block.head(valid + 1), torch.cat([allowed, allowed[-1:]])
        return block.head(valid), allowed

    def _fill(
        self,
        request: DraftRequest,
        ctx: Context,
        block: Draft,
        ceiling: int,
        usage: Usage,
        ran: list[str],
        ended: list[str],
    ) -> Draft:
        """Step 1, the horizontal cascade: the row's drafters in order, each until the block holds its goal
        (`self.fill`), never past `ceiling`. Each drafter goes into `ran` if it was called, into `ended` if the block
        had ended before its turn (neither: "total" used its quota up)."""
        goal = 0
        for drafter, quota in self.drafters:
            goal = min(self.fill.goal(len(block), goal, quota), ceiling)
            if len(block) >= ceiling or self._ends_in_eos(block):
                ended.append(drafter.name)
                continue
            if len(block) >= goal:
                continue
            ran.append(drafter.name)
            while len(block) < goal and not self._ends_in_eos(block):
                asked = goal - len(block)
                reply = drafter.draft(self._ask(request, ctx.extend(block.tokens), asked, ceiling - len(block)))
                absorb(usage, reply.usage)
                if not reply.draft:
                    break
                block = block + reply.draft
                if len(reply.draft) < asked and reply.stopped:
                    break  # its stopping rule ended its part of the block: the next drafter takes over
        return block

    def _ends_in_eos(self, block: Draft) -> bool:
        return bool(block.tokens) and block.tokens[-1] in self.state.eos_ids


def build_cascade(
    target: Tier,
    drafters: Sequence[Tier],
    schedule: Schedule,
    leniency: float,
    state: RequestState,
    lookup: Lookup | None = None,
    strict_top: bool = True,
) -> CascadeTier:
    """The target's system for one request: drafters largest first, wired by the K-matrix.

    Row r of the schedule belongs to reviewer T_r (T_0 the target, T_r the r-th drafter); a drafter
    whose row is all zeros, and the last drafter, draft alone. Each tier's system is built once and
    shared by every row that uses it, so one tier keeps one KV cache per request. `lookup` gates MaG
    (the drafter named "mag") in front of the target's row. `strict_top=False` builds an inner tier's
    system (reviewing with `leniency`), e.g. a sub-cascade run inside a tier's replica. A drafter whose
    `system` is true runs its whole sub-cascade itself and is asked for drafts like a leaf.
    """
    if leniency < 1.0:
        raise ValueError(f"leniency must be >= 1, got {leniency}")
    tiers: list[Tier] = [target, *drafters]
    for tier in tiers:
        state.stats.tier(tier.name)  # listed even if the schedule never calls it: the stats show that
    systems: dict[int, Tier] = {}
    above: list[tuple[Tier, CascadeTier]] = []  # (a system, a reviewer whose row drafts with it)
    for r in range(len(tiers) - 1, -1, -1):  # bottom-up: a reviewer needs the systems below it
        tier = tiers[r]
        if r > 0 and (tier.system or schedule.is_leaf(r)):
            systems[r] = tier
            continue
        row = [(systems[c + 1], quota) for c, quota in schedule.row(r)] if drafters else []
        # The target reviews strictly (Algorithm 1: "if isFirstCall then l <- 1") but for a lossy rule (core.verify)
        final = r == 0 and strict_top
        spec = state.adaptive.get(tier.name) if r > 0 else None
        stopper = None
        if spec is not None:
            if state.make_stopper is None:
                raise ValueError(
                    f"adaptive draft length for reviewing tier {tier.name!r} needs its model in this "
                    "process (or its whole sub-cascade in its replica)"
                )
            stopper = state.make_stopper(spec)
        systems[r] = reviewer = CascadeTier(tier, row, 1.0 if final else leniency, state, final, stopper, schedule.fill)
        above += [(child, reviewer) for child, _ in row]
        state.stats.reviewer(tier.name)
    for r, system in systems.items():  # an inner tier's verdict probabilities: read by a reviewer above?
        if r > 0 and isinstance(system, CascadeTier):
            system.unread = not any(reader.reads_drafts() for child, reader in above if child is system)
    top = systems[0]
    assert isinstance(top, CascadeTier)
    if lookup is not None:
        gated = [t for t in drafters if t.name == lookup.tier]
        if not gated:
            raise ValueError(f"lookup needs the drafter {lookup.tier!r} among the drafters")
        top.lookup = (gated[0], lookup)
        state.stats.tier(f"{lookup.tier}_lookup")
    return top
