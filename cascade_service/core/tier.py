"""One protocol for every tier, with typed messages: draft, review, release.

A tier is whatever the cascade asks for a draft or a review: a model in this process
(`core.local.ModelTier`), MaG (`core.local.StatisticalTier`), a reviewer over the tiers below it
(`core.cascade.CascadeTier`), or a tier in another process (`transport.remote.RemoteTier`, which
sends these same messages through the wire codec, `transport.codec`). The cascade calls this
protocol and never asks which kind of tier it holds.

Every call says what it cost in its reply (`Usage`), so the caller adds it up wherever the work ran:
in this thread, in a batched pass, or in another process. Every call that may sample carries its own
`seed`, drawn from the request's RNG, so a request is reproducible and gives the same tokens whether
its tiers run in this process or elsewhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .adaptive import AdaptiveLength
from .grammar import GrammarMask, GrammarSpec
from .review import Verdict
from .sampling import SamplingParams
from .stats import Usage
from .types import Context, Draft
from .verify import EXACT, Verification

GREEDY = SamplingParams()  # frozen: one shared default


@dataclass(frozen=True)
class DraftRequest:
    """Draft up to `want` tokens after `context`, never more than `limit`.

    A tier drafting alone drafts min(want, limit); a reviewer over tiers drafts by its own K-matrix row
    and may overshoot `want` up to `limit`. `adaptive` holds the request's adaptive draft lengths by
    tier name: a tier applies its own, and a sub-cascade passes the rest down. `min_match` > 0 asks
    only for an n-gram continuation of a match at least that long (MaG's lookup gate, `core.schedule.Lookup`);
    a tier with no such notion drafts nothing.
    """

    request_id: str
    context: Context
    want: int
    limit: int
    sampling: SamplingParams = GREEDY
    seed: int = 0
    eos_ids: frozenset[int] = frozenset()
    adaptive: Mapping[str, AdaptiveLength] = field(default_factory=dict)
    min_match: int = 0
    cache_salt: str = ""  # the prefix cache the request may read and add to (its API key's: models.kvpool)
    # The request's response format, for a model drafter to mask each step with (core.grammar): its
    # state in the coordinator's process; over the wire, its spec, which a tier server follows with a
    # state of its own (tierhost.group).
    grammar: GrammarMask | GrammarSpec | None = field(default=None, compare=False, repr=False)
    # A lossless sampled request's draws are keyed by (seed, position) (core.sampling `race`): `seed` is
    # then the request's own, the same in every call; otherwise each call's seed is drawn afresh.
    keyed: bool = False

    @property
    def k(self) -> int:
        """How many tokens a tier drafting alone drafts."""
        return max(0, min(self.want, self.limit))

    def asking(
        self,
        context: Context,
        want: int,
        limit: int,
        seed: int,
        min_match: int,
        grammar: GrammarMask | GrammarSpec | None,
        keyed: bool,
    ) -> DraftRequest:
        """This request for a drafter below: its other fields as they are. Built field by field, not by
        dataclasses.replace, which reads every field's metadata on each call (a round asks 2-3 times)."""
        return DraftRequest(
            self.request_id,
            context,
            want,
            limit,
            self.sampling,
            seed,
            self.eos_ids,
            self.adaptive,
            min_match,
            self.cache_salt,
            grammar,
            keyed,
        )


@dataclass
class DraftReply:
    """A draft block. `stopped`: the tier's own stopping rule (adaptive draft length) ended it before
    `want`, so the next drafter in the horizontal cascade takes over the rest of the block."""

    draft: Draft
    usage: Usage = field(default_factory=Usage)
    stopped: bool = False


@dataclass(frozen=True)
class ReviewRequest:
    """Score `context` + `block` in one forward pass and review the block.

    `leniency` applies at inner reviews (1 at the target's); `verification` is the final verifier's
    rule (exact unless the request asked for a lossy one). `hidden` asks for the reviewer's hidden
    states at the block's positions (SpecDec++ at a reviewing tier); only a tier in this process has them.
    """

    request_id: str
    context: Context
    block: Draft
    leniency: float = 1.0
    sampling: SamplingParams = GREEDY
    seed: int = 0
    verification: Verification = EXACT
    hidden: bool = False
    cache_salt: str = ""  # as DraftRequest's
    logprobs: int = -1  # >= 0: the verdict carries the emitted tokens' logprobs with this many alternatives
    allowed: torch.Tensor | None = None  # [len(block) + 1, V] bool: the tokens a response format allows
    keyed: bool = False  # as DraftRequest's: the review is `core.review.KeyedReview` (exact verification only)
    # No reviewer above reads the verdict's token_probs (the target's review; an inner tier's whose every
    # reviewer is strict: core.cascade.build_cascade). A greedy review then decides on logits, computing at
    # most a lenient check's rows (core.review.GreedyReview.decide).
    probs_unread: bool = False

    def __post_init__(self) -> None:
        if self.keyed and self.verification.rule != "exact":
            raise ValueError(f"keyed draws need exact verification; got verification.rule {self.verification.rule!r}")


@dataclass
class ReviewReply:
    """A review's verdict. `hidden`: [k + 1, H], row j the hidden state before block token j (only when asked)."""

    verdict: Verdict
    usage: Usage = field(default_factory=Usage)
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class Release:
    """The request is over: drop what the tier keeps for it (its KV cache, its MaG index).

    `tokens`: its committed sequence at the end (context and output; empty: not known), so a model
    tier's prefix cache keeps the blocks of it that its cache holds (the last round's, which no later
    call confirmed, included)."""

    request_id: str
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class TierFacts:
    """What the coordinator needs to know of a loaded model tier (a tier replica's `info()`)."""

    vocab_size: int  # the LM head's rows
    num_parameters: int
    eos_token_ids: tuple[int, ...]
    max_positions: int | None  # None: the model names no limit
    device: str
    # An encoder-decoder model's decoder start token (a request's context is its prompt, then this:
    # models.seq2seq); None for a decoder-only model.
    decoder_start: int | None = None


@dataclass(frozen=True)
class Scope:
    """Whom one request's tiers serve: the request, the prefix cache it may read and add to (its API
    key's salt: models.kvpool), and the key that routes its calls to the replicas that likely hold
    its prefix (a session's, or its prompt's head: `affinity_key`)."""

    request_id: str
    cache_salt: str = ""
    affinity: str = ""


AFFINITY_TOKENS = 64  # a prompt's head that routes it: requests sharing a header of this length meet


def affinity_key(salt: str, session_id: str | None, context: Sequence[int]) -> str:
    """The routing key of a request: its session's (every turn to the same replicas), else its
    prompt head's, under its API key's salt (keys never share a replica's cache)."""
    what = f"session\0{session_id}" if session_id else "head\0" + ",".join(map(str, context[:AFFINITY_TOKENS]))
    return hashlib.blake2b(f"{salt}\0{what}".encode(), digest_size=12).hexdigest()


class Tier(Protocol):
    """A tier of the cascade: it drafts, reviews, and lets go of a finished request.

    `system` is true for a tier whose `draft` runs its whole sub-cascade (it reviewing the tiers below
    it) where it lives: the cascade then asks it for drafts like a tier drafting alone. A tier that
    cannot review (MaG) raises TypeError from `review`; schedules never ask it to.
    """

    name: str
    system: bool

    def draft(self, request: DraftRequest) -> DraftReply: ...

    def review(self, request: ReviewRequest) -> ReviewReply: ...

    def release(self, request: Release) -> None: ...


class Unavailable(Exception):
    """A tier could not be reached (replica died, deployment restarting): retryable. Whatever carried
    the call raises it; the edge maps it to UNAVAILABLE."""


class Overloaded(Exception):
    """A tier's bounded queue is full: RESOURCE_EXHAUSTED at the edge, retry later."""


def call_seed(generator: torch.Generator) -> int:
    """A seed for one tier call, drawn from the request's RNG so the request stays reproducible."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))
