"""The few shapes every tier and drafter share: the context they extend and the draft they return."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .placement import join_rows, to_reviewer


@dataclass(frozen=True)
class Context:
    """A token sequence to extend.

    `tokens[:stable]` is committed output (prompt + accepted tokens) and never changes for the rest of
    the request; the tail is pending draft. KV caches and MaG's index trust the stable part, so their
    per-call work is bounded by the tail, not by the sequence length.
    """

    tokens: list[int]
    stable: int

    def extend(self, more: Sequence[int]) -> Context:
        if not more:
            return self
        return Context(self.tokens + list(more), self.stable)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Draft:
    """A block of proposed tokens with what a reviewer needs to judge them.

    `token_probs[i]` is the proposal probability of `tokens[i]` (greedy leniency compares against it).
    `dists` holds the full proposal distribution per position, [k, V]; only sampling mode carries it,
    since the residual max(0, target - draft) needs the whole row. MaG's rows are point masses. The
    rows live on the device of whoever made them until a reviewer takes them (`for_reviewer`).
    `origins[i]` names the drafter that contributed the token (stats only).
    An empty draft is a valid draft.
    """

    tokens: list[int] = field(default_factory=list)
    token_probs: list[float] = field(default_factory=list)
    dists: torch.Tensor | None = None  # [k, V] float32, or None in greedy mode
    origins: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def __add__(self, other: Draft) -> Draft:
        dists: torch.Tensor | None
        if self.dists is not None and other.dists is not None:
            dists = join_rows(self.dists, other.dists)  # drafters may sit on different devices
        elif (self.dists is None or not self) and (other.dists is None or not other):
            dists = other.dists if self.dists is None else self.dists
        else:
            raise ValueError("cannot join a greedy draft (no dists) with a sampled one")
        return Draft(
            self.tokens + other.tokens,
            self.token_probs + other.token_probs,
            dists,
            self.origins + other.origins,
        )

    def for_reviewer(self, target_probs: torch.Tensor) -> Draft:
        """This block with its rows where the reviewer's `target_probs` are, in float32 (core.placement)."""
        if self.dists is None:
            return self
        return Draft(self.tokens, self.token_probs, to_reviewer(self.dists, target_probs), self.origins)

    @classmethod
    def point(cls, tokens: list[int], vocab_size: int, rows: bool, origin: str) -> Draft:
        """A deterministic drafter's block (MaG, a lookup, the grammar's forced tokens): each token
        proposed with probability 1, its row (`rows`: sampling carries them) a point mass."""
        dists = None
        if rows:
            dists = torch.zeros(len(tokens), vocab_size)
            if tokens:  # a lookup that found nothing (most rounds at T = 1) skips the indexing's dispatch
                dists[torch.arange(len(tokens)), tokens] = 1.0
        return cls(list(tokens), [1.0] * len(tokens), dists, [origin] * len(tokens))

    def head(self, n: int) -> Draft:
        return Draft(
            self.tokens[:n],
            self.token_probs[:n],
            None if self.dists is None else self.dists[:n],
            self.origins[:n],
        )


class Scorer(Protocol):
    """One tier's language model for one request (it owns that request's KV cache).

    `logits(ctx, n)` returns [n, V] float32 logits: row j predicts the token after
    `ctx.tokens[:len(ctx) - n + 1 + j]`. A reviewer asks for n = k + 1 (k drafts + bonus), an
    autoregressive drafter for n = 1. Implementations keep their cache across calls and crop it where
    the context diverges from what they processed before (a rejected draft), never re-prefilling the
    stable prefix. `tokens_processed` counts every token fed through the model.
    """

    name: str
    tokens_processed: int

    def logits(self, ctx: Context, n: int) -> torch.Tensor: ...
