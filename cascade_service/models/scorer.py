"""One request's scorer over a loaded model: its KV cache, rolled back by cropping, and its prefix
reuse (models.kvpool): a fresh cache starts from the longest cached prefix of the committed tokens
under its salt, and publishes its own full committed blocks as it goes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from cascade_service.core.types import Context

from .batching import PassQueue
from .kvpool import KVCache, KVPool, PagedCache


class ScoredModel(Protocol):
    """What a scorer needs of its model (`models.hf.HFModel` is one): the scorer is made by the model,
    so this module never imports the model's."""

    name: str
    kv_pool: KVPool
    batcher: PassQueue | None  # where its passes wait for the engine's step, once it joined one

    def new_cache(self, salt: str = "") -> KVCache: ...

    def forward(
        self, tokens: Sequence[int], cache: KVCache, keep: int, with_hidden: bool = False, chain: int = 1
    ) -> Any: ...


class HFScorer:
    """Scorer over one HFModel for one request: keeps a KV cache and rolls it back by cropping.

    `logits` returns float32 rows on the model's device (the caller moves them if it needs to).
    Not thread-safe: one request, one scorer.
    With `keep_hidden` set, each `logits` call also leaves the model's final hidden states of the
    same rows in `last_hidden` ([n, H] float32; SpecDec++'s acceptance head reads them).
    """

    keep_hidden: bool = False
    last_hidden: torch.Tensor | None = None

    def __init__(self, model: ScoredModel, salt: str = ""):
        self.name = model.name
        self.tokens_processed = 0
        self.tokens_cached = 0  # positions the prefix cache gave instead of a pass (models.kvpool)
        self._model = model
        self._salt = salt
        self._cache = model.new_cache(salt)
        self._tokens: list[int] = []  # the tokens whose keys/values the cache holds, in order
        # self._tokens[:_trusted] are committed tokens of the request (they were below ctx.stable),
        # which never change, so the prefix match may skip them.
        self._trusted = 0

    def logits(self, ctx: Context, n: int) -> torch.Tensor:
        """[n, V] float32 logits; row j predicts the token after `ctx.tokens[:len(ctx) - n + 1 + j]`."""
        if not 1 <= n <= len(ctx):
            raise ValueError(f"n must be in [1, {len(ctx)}] for a context of {len(ctx)} tokens, got {n}")
        fed = self._fed(ctx, n)
        # No inference_mode here: the pass enters it where it runs (HFModel.forward); entering it around
        # every call cost ~10 us a call on a round's critical path.
        try:
            if self.keep_hidden:
                rows, self.last_hidden = self._model.forward(fed, self._cache, n, with_hidden=True)  # [n, V], [n, H]
            else:
                rows = self._model.forward(fed, self._cache, n)  # [n, V]
        finally:
            self._settle()
        self._fed_done(ctx, fed)
        return rows

    @property
    def chains(self) -> bool:
        """Whether `draft_greedy` runs its steps chained on the device (models.chain): a model with a
        fixed-shape runner, over a pool."""
        return getattr(self._model, "static", None) is not None and isinstance(self._cache, PagedCache)

    def draft_greedy(self, ctx: Context, k: int) -> tuple[list[int], list[float]]:
        """k greedy tokens after `ctx` and each one's probability (softmax at temperature 1), from one
        chained run of k passes with one read back to the host (models.chain). The cache then holds
        ctx and the first k - 1 of them; the caller cuts the draft where it likes (an EOS), and the
        next call rolls the cache back to what it shares with that call's context."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        fed = self._fed(ctx, 1)
        try:
            tokens, probs = self._model.forward(fed, self._cache, 1, chain=k)
        finally:
            self._settle()
        self._fed_done(ctx, fed + tokens[:-1])
        return tokens, probs

    def _fed(self, ctx: Context, n: int) -> list[int]:
        """What a pass for ctx's last n rows feeds, after the cache is rolled back to what it shares
        with ctx (a fresh cache attaches ctx's cached prefix first)."""
        cache = self._cache
        if cache.get_seq_length() < len(self._tokens):  # the pool preempted the cache: re-read the rest
            self._rollback(cache.get_seq_length())
        # Logits are not cached, so the first requested row's input token is re-fed even if cached.
        start = min(self._common_prefix(ctx.tokens), len(ctx) - n)
        self._rollback(start)
        if start == 0 and isinstance(self._cache, PagedCache):
            start = self._attach(ctx, n)
        return list(ctx.tokens[start:])

    def _settle(self) -> None:
        if isinstance(self._cache, PagedCache):
            self._model.kv_pool.settle(self._cache)

    def _fed_done(self, ctx: Context, fed: list[int]) -> None:
        """The cache now holds `fed` after what it held: count them, publish ctx's committed blocks."""
        self._tokens.extend(fed)
        self.tokens_processed += len(fed)
        self._trusted = min(max(self._trusted, ctx.stable), len(self._tokens))
        if isinstance(self._cache, PagedCache):
            self._model.kv_pool.publish(self._cache, self._tokens, self._trusted)

    def _attach(self, ctx: Context, n: int) -> int:
        """A fresh cache starts from the longest cached prefix of the committed tokens; where another
        request is computing the next blocks of it now, it waits for them rather than computing them
        too (so requests that arrive together with one long header read it once)."""
        pool, cache = self._model.kv_pool, self._cache
        assert isinstance(cache, PagedCache)
        limit = min(ctx.stable, len(ctx) - n)
        while True:
            start = pool.attach(cache, ctx.tokens, limit)
            theirs = pool.claim(cache, ctx.tokens, limit)
            if theirs is None:
                break
            queue = self._model.batcher
            if queue is not None:
                queue.wait(theirs)  # in an engine task it parks; the claimant's pass runs meanwhile
            else:
                theirs.result()
            pool.truncate(cache, 0)  # and look again: the blocks are published now, or were given up
        pool.looked_up(limit, start)
        self._tokens = ctx.tokens[:start]
        self._trusted = start
        self.tokens_cached += start
        return start

    def finish(self, tokens: Sequence[int]) -> None:
        """The request ended with `tokens` committed: publish the blocks the cache holds of them
        (past what earlier calls could confirm: the last round's tokens)."""
        if isinstance(self._cache, PagedCache):
            self._model.kv_pool.publish(self._cache, self._tokens, self._common_prefix(tokens))

    def reset(self) -> None:
        """Drop the KV cache (frees its memory); the next call re-prefills. Counters are kept."""
        self._cache = self._model.new_cache(self._salt)
        self._tokens = []
        self._trusted = 0

    def _common_prefix(self, tokens: Sequence[int]) -> int:
        # Only the pending tail is compared: O(draft length), not O(sequence length).
        limit = min(len(self._tokens), len(tokens))
        i = min(self._trusted, limit)
        while i < limit and self._tokens[i] == tokens[i]:
            i += 1
        return i

    def _rollback(self, length: int) -> None:
        # Cropping the cache is how a rejected draft is undone; the committed prefix stays cached.
        if length == 0:
            self.reset()
            return
        # Negative crop = tokens to remove: the form both transformers 4.x and 5.x accept. Never 0:
        # crop(0) empties a DynamicCache before transformers 5.14 and is a no-op after.
        if (drop := self._cache.get_seq_length() - length) > 0:
            self._cache.crop(-drop)
        del self._tokens[length:]
        self._trusted = min(self._trusted, length)
