"""Suffix decoding: a statistical drafter over suffix tries of this request, of recent ones of the
same API key, and of a shared corpus.

After Arctic Inference's suffix decoding (Oliaro et al., "SuffixDecoding", 2024), as vLLM runs it.
Tries of every substring of at most `depth` tokens, each node counting the occurrences of its path:
- the request's own trie over its prompt and output so far, grown by O(depth) per committed token;
- a trie over the sequences of recently finished requests of the same API key (`SuffixCache`, one
  per key in `TenantCaches`), bounded in tokens per key and over all keys: when a key's is full, its
  oldest sequences are dropped and its trie rebuilt from the rest; when all keys' together are over
  their bound, the least recently used keys go. One key's text never drafts for another key
  (invariant 8): under a lossy rule a draft can be accepted into the output, and under any rule the
  speed of a request would tell whether another key had sent similar text;
- optionally a read-only trie over a corpus the operator configured for every key (`corpus`).
A call finds, in each trie, the longest suffix of the context (at most `depth` tokens) that occurred
before with a continuation, then follows the most frequent continuation from there while the product
of the continuation frequencies stays at least `min_prob`, for at most `factor` x the match length
tokens (a long match earns a long draft) and at most k. The trie whose path scores higher (the sum of
those products, i.e. the expected number of accepted tokens) proposes.

Unlike MaG (core.proposers.mag), which takes the earliest occurrence of the longest match, suffix decoding
weighs every occurrence, so a continuation seen five times beats one seen once, and it drafts nothing
rather than a guess when the evidence is thin (no bigram fill).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..types import Context


class SuffixTrie:
    """Every substring of at most `depth` tokens of the sequences added, with occurrence counts.

    Flat, for speed in Python: node ids, edges in one dict keyed by (node, token), and per node its
    count, the sum of its children's counts (`total`) and its most frequent child (`best`, the
    earliest on a tie), kept as counts grow, so a draft follows `best` without looking at the others.
    Node 0 is the root.
    """

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"depth must be at least 2, got {depth}")
        self.depth = depth
        self.edges: dict[tuple[int, int], int] = {}
        self.count = [0]
        self.total = [0]
        self.best = [-1]
        self.token = [-1]  # the token on the edge into each node

    @property
    def nodes(self) -> int:
        """Nodes held, the root apart: what the trie's memory grows with."""
        return len(self.count) - 1

    def step(self, node: int, token: int) -> int:
        """Count one more occurrence of `token` after `node`'s path; the child's id."""
        child = self.edges.get((node, token))
        if child is None:
            child = self.edges[(node, token)] = len(self.count)
            self.count.append(0)
            self.total.append(0)
            self.best.append(-1)
            self.token.append(token)
        self.count[child] += 1
        self.total[node] += 1
        best = self.best[node]
        if best < 0 or (best != child and self.count[child] > self.count[best]):
            self.best[node] = child
        return child

    def add(self, tokens: Sequence[int]) -> None:
        """Count every substring of `tokens` up to `depth` long once more."""
        for start in range(len(tokens)):
            node = 0
            for token in tokens[start : start + self.depth]:
                node = self.step(node, token)

    def walk(self, tokens: Sequence[int]) -> int:
        """The node of `tokens`' path; -1 when it never occurred."""
        node, edges = 0, self.edges
        for token in tokens:
            found = edges.get((node, token))
            if found is None:
                return -1
            node = found
        return node

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(node, length) of the longest suffix of `tokens` (shorter than depth) that occurred with a
        continuation; (-1, 0) when none did.

        Binary search over the length: a suffix that occurred with a continuation implies every
        shorter suffix of it did (at the same place), so the property is monotone in the length.
        """
        lo, hi, best = 1, min(self.depth - 1, len(tokens)), (-1, 0)
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.walk(tokens[len(tokens) - mid :])
            if node >= 0 and self.total[node]:
                lo, best = mid + 1, (node, mid)
            else:
                hi = mid - 1
        return best


class _Growing(SuffixTrie):
    """The request's own trie, extended token by token: O(depth) per token, not O(depth^2)."""

    def __init__(self, depth: int):
        super().__init__(depth)
        self._open: list[int] = []  # nodes of the suffixes shorter than depth that end at the last token

    def append(self, token: int) -> None:
        step = self.step
        self._open = [step(node, token) for node in [0, *self._open[: self.depth - 1]]]


@dataclass(frozen=True)
class SuffixSettings:
    depth: int = 24  # the longest substring indexed, and the longest suffix matched
    factor: float = 1.0  # at most factor x match length tokens per draft (Arctic's max_spec_factor)
    min_prob: float = 0.1  # stop once the path's estimated probability falls below this
    cache_tokens: int = 32768  # tokens of finished requests the global trie holds (0: no global trie)


class SuffixCache:
    """A trie over the token sequences of recently finished requests, at most `cache_tokens` tokens of
    them (a sequence longer than that keeps its tail), so at most depth x cache_tokens nodes whatever
    the traffic (about 166 bytes a node in CPython; docs/benchmarks.md). Shared by the concurrent
    requests of one key in one process, behind a lock. `grown` is called after each sequence is
    remembered (TenantCaches checks its bound over all keys there).
    """

    def __init__(self, settings: SuffixSettings, grown: Callable[[], None] | None = None):
        self.settings = settings
        self.trie = SuffixTrie(settings.depth)
        self._held: deque[list[int]] = deque()
        self.held_tokens = 0
        self._lock = threading.Lock()
        self._grown = grown

    def remember(self, tokens: Sequence[int]) -> None:
        self._remember(tokens)
        if self._grown is not None:
            self._grown()

    def _remember(self, tokens: Sequence[int]) -> None:
        budget = self.settings.cache_tokens
        if budget <= 0 or not tokens:
            return
        tail = list(tokens[-budget:])
        with self._lock:
            self._held.append(tail)
            self.held_tokens += len(tail)
            if self.held_tokens <= budget:
                self.trie.add(tail)
                return
            # Full: the oldest go until a quarter of the budget is free, and the trie is rebuilt from
            # the rest (counts cannot be taken back cheaply from a flat trie); amortised, each token is
            # indexed about four times over its stay.
            while self.held_tokens > budget * 3 // 4 and len(self._held) > 1:
                self.held_tokens -= len(self._held.popleft())
            self.trie = SuffixTrie(self.settings.depth)
            for held in self._held:
                self.trie.add(held)

    def clear(self) -> None:
        with self._lock:
            self.trie = SuffixTrie(self.settings.depth)
            self._held.clear()
            self.held_tokens = 0

    @property
    def nodes(self) -> int:
        return self.trie.nodes

    def draft(self, tokens: Sequence[int], k: int) -> tuple[list[int], float, int]:
        with self._lock:
            return _follow(self.trie, tokens, k, self.settings)


class TenantCaches:
    """One `SuffixCache` per API key (its owner id; "" when the service has no keys), created on a
    key's first request, at most `settings.cache_tokens` tokens each and `total_tokens` over all keys:
    past that, the least recently used keys' caches are dropped whole (a request still running keeps
    drafting from the one it holds). Memory is thus bounded by depth x total_tokens nodes whatever the
    number of keys."""

    def __init__(self, settings: SuffixSettings, total_tokens: int):
        self.settings = settings
        self.total_tokens = total_tokens
        self._caches: OrderedDict[str, SuffixCache] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def of(self, owner: str) -> SuffixCache:
        """The key's cache (created on first use), now its most recently used."""
        with self._lock:
            cache = self._caches.get(owner)
            if cache is None:
                cache = self._caches[owner] = SuffixCache(self.settings, self._trim)
            self._caches.move_to_end(owner)
            return cache

    @property
    def held_tokens(self) -> int:
        with self._lock:
            return sum(c.held_tokens for c in self._caches.values())

    def owners(self) -> list[str]:
        """The keys with a cache, least recently used first."""
        with self._lock:
            return list(self._caches)

    def clear(self) -> None:
        with self._lock:
            self._caches.clear()

    def _trim(self) -> None:
        with self._lock:
            held = sum(c.held_tokens for c in self._caches.values())
            while held > self.total_tokens and len(self._caches) > 1:
                _, dropped = self._caches.popitem(last=False)
                held -= dropped.held_tokens


def corpus_cache(settings: SuffixSettings, sequences: Sequence[Sequence[int]]) -> SuffixCache:
    """A read-only trie over an operator's corpus, for every key: all of `sequences`, however long
    (the config bounds them), indexed once."""
    held = sum(len(s) for s in sequences)
    cache = SuffixCache(SuffixSettings(settings.depth, settings.factor, settings.min_prob, max(held, 1)))
    for sequence in sequences:
        cache.remember(sequence)
    return cache


def _follow(trie: SuffixTrie, tokens: Sequence[int], k: int, settings: SuffixSettings) -> tuple[list[int], float, int]:
    """(draft, score, match length): the most frequent continuation of the longest matched suffix.

    A path that reaches the trie's depth has no children there; the draft then goes on from the
    longest match of the sequence with the draft so far, as a fresh call would.
    """
    node, length = trie.match(tokens)
    if node < 0:
        return [], 0.0, 0
    limit = min(k, max(1, math.floor(settings.factor * length)))
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < limit:
        if not trie.total[node]:
            node = trie.match([*tokens[len(tokens) - trie.depth :], *draft])[0]
            if node < 0:
                break
        child = trie.best[node]
        prob *= trie.count[child] / trie.total[node]
        if prob < settings.min_prob:
            break
        draft.append(trie.token[child])
        score += prob
        node = child
    return draft, score, length


class SuffixDecoder:
    """One request's suffix drafter: its own trie, its key's `SuffixCache` of finished requests, and
    the shared corpus if there is one.

    Its draft length is its own (confidence and match length): a short draft is not to be extended
    by asking again (`decides_length`)."""

    decides_length = True

    def __init__(self, cache: SuffixCache, corpus: SuffixCache | None = None):
        self.cache = cache
        self.corpus = corpus
        self.settings = cache.settings
        self.own = _Growing(self.settings.depth)
        self._tokens: list[int] = []
        self.matched = 0  # the match length behind the last draft (what the lookup gate reads)
        # Where the request's own trie goes at its end, with its final tokens (engine.leaves keeps it
        # for a request that continues them); None: it goes with the request.
        self.keep: Callable[[tuple[int, ...], SuffixDecoder], None] | None = None

    def propose(self, ctx: Context, k: int) -> list[int]:
        """Up to k tokens to follow ctx.tokens; empty when no trie has evidence enough."""
        self._commit(ctx)
        tokens = ctx.tokens
        # The request's own trie holds its committed tokens; the pending tail (drafts under review)
        # is matched against, not indexed: it may still be rejected.
        found = [_follow(self.own, tokens, k, self.settings), self.cache.draft(tokens, k)]
        if self.corpus is not None:
            found.append(self.corpus.draft(tokens, k))
        draft, _, self.matched = max(found, key=lambda f: f[1])
        return draft

    def lookup(self, ctx: Context, k: int, min_match: int) -> list[int]:
        """A draft only when its match is at least `min_match` tokens long (the lookup gate)."""
        draft = self.propose(ctx, k)
        return draft if self.matched >= min_match else []

    @property
    def indexed(self) -> int:
        """Committed tokens in the request's own trie."""
        return len(self._tokens)

    def finish(self, tokens: Sequence[int] = ()) -> None:
        """The request is over: its sequence (as committed to it) joins its key's trie for the requests
        after it; given its final `tokens`, its own trie takes them in and goes to `keep`."""
        self.cache.remember(self._tokens)
        if tokens and self.keep is not None and len(tokens) >= len(self._tokens):
            self._commit(Context(list(tokens), len(tokens)))
            self.keep(tuple(tokens), self)

    def _commit(self, ctx: Context) -> None:
        for token in ctx.tokens[len(self._tokens) : ctx.stable]:
            self.own.append(token)
            self._tokens.append(token)
