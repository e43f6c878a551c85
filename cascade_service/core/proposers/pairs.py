"""MaG's light index (`mag.MaxGram`'s propose and lookup read it first): each committed token pair's
followers and each token's first follower, four dict operations on ints a token where MaG's n-gram trie
takes two per length (max_ngram 16). A match is extended leftwards by comparing tokens, so what it finds
is the trie's: the earliest occurrence of the longest suffix, up to max_ngram tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from cascade_service.core.types import Context

PAIR_CANDIDATES = 64  # a pair's earlier occurrences a match compares at most before MaG reads the trie
_KEY = 1 << 32  # a pair's key: first * _KEY + second (an int: dicts of ints alone are not the GC's to traverse)


class PairIndex:
    """MaG's light index of the committed tokens: each pair's followers, in order (a chain through
    one list: `head`, then `chain[j]`, 0 where it ends), and each token's first follower. Only ints:
    a dict or list of containers per pair made every collection of the GC walk them all. A match is the
    earliest of the longest: the pair's followers (the committed ones, then the tail's and the
    proposal's, read directly) extended leftwards by comparison, up to max_ngram; without one, the last
    token's first follower (a match of one token, which only a virtual extension after a longer first
    match may use)."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.head: dict[int, int] = {}  # pair -> its first follower
        self.last: dict[int, int] = {}  # pair -> its latest follower, where the chain grows
        self.chain: list[int] = [0, 0]  # follower j -> the next follower of the same pair (0: none)
        self.first: dict[int, int] = {}  # token -> its first follower
        self.indexed = 0  # follower positions < indexed are in the dicts
        self.ops = 0

    def add(self, tokens: Sequence[int], stable: int) -> None:
        """Index the followers in [indexed, stable) of `tokens` (its committed tokens never change)."""
        if stable <= self.indexed:
            return
        head, last, chain, first = self.head, self.last, self.chain, self.first
        if self.indexed < 2 <= stable:
            first.setdefault(tokens[0], 1)
        for j in range(max(self.indexed, 2), stable):
            a, b = tokens[j - 2], tokens[j - 1]
            first.setdefault(b, j)
            key = a * _KEY + b
            prev = last.get(key)
            if prev is None:
                head[key] = j
            else:
                chain[prev] = j
            last[key] = j
            chain.append(0)
        self.ops += 4 * (stable - self.indexed)
        self.indexed = stable

    def lookup(self, ctx: Context, k: int, min_match: int) -> list[int] | None:
        """What `mag.MaxGram.lookup` returns (with min_match 1, propose's matches before its bigram fill),
        or None where a pair recurs too often to compare (MaG reads the trie then)."""
        tokens = ctx.tokens
        self.add(tokens, ctx.stable)
        n = len(tokens)
        proposal: list[int] = []
        virtual = _Virtual(tokens, proposal)
        end = n
        while len(proposal) < k:
            # The first match reads only the tokens: most lookups end there, so it skips the wrapper.
            seq: Sequence[int] = virtual if proposal else tokens
            found = self._match(seq, end)
            if found is None:
                return None
            start, length = found
            if not proposal and length < min_match:
                return []
            if start < 0:
                break
            proposal += [seq[i] for i in range(start, min(end, start + k - len(proposal)))]
            end = n + len(proposal)
        return proposal

    def _match(self, seq: Sequence[int], end: int) -> tuple[int, int] | None:
        """(follower, length) of the longest match of seq[:end]'s suffix, (-1, 0) if none, None if the
        last pair recurs more than PAIR_CANDIDATES times among the committed tokens."""
        cap = min(self.max_ngram, end - 1)
        if cap < 1:
            return -1, 0
        before, last = seq[end - 2], seq[end - 1]
        if cap >= 2:
            committed: list[int] = []
            j = self.head.get(before * _KEY + last, 0)
            while j:
                if len(committed) == PAIR_CANDIDATES:
                    return None
                committed.append(j)
                j = self.chain[j]
            scan = range(max(self.indexed, 2), end)  # the tail's and the proposal's followers: a few
            tail = [j for j in scan if seq[j - 1] == last and seq[j - 2] == before]
            self.ops += len(committed) + len(scan)
            best, length = -1, 0
            for j in itertools.chain(committed, tail):  # in order: the earliest of the longest wins
                limit, n = min(cap, j), 2
                while n < limit and seq[j - n - 1] == seq[end - n - 1]:
                    n += 1
                self.ops += n
                if n > length:
                    best, length = j, n
                    if n == cap:
                        break
            if best >= 0:
                return best, length
        self.ops += 1
        j = self.first.get(last, -1)
        if j < 0:
            scan = range(max(self.indexed, 1), end)
            self.ops += len(scan)
            j = next((j for j in scan if seq[j - 1] == last), -1)
        return (j, 1) if j >= 0 else (-1, 0)


class _Virtual(Sequence[int]):
    """tokens + proposal, read without copying the tokens."""

    def __init__(self, tokens: list[int], proposal: list[int]):
        self.tokens, self.proposal, self.n = tokens, proposal, len(tokens)

    def __len__(self) -> int:
        return self.n + len(self.proposal)

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        return self.tokens[i] if i < self.n else self.proposal[i - self.n]
