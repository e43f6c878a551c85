"""The MaG lookup's light index (`mag.MaxGram.lookup`, `min_match` >= 2): each committed token pair's
followers and each token's first follower, two dict operations a token where MaG's n-gram trie takes
max_ngram (16). A match is extended leftwards by comparing tokens, so what it finds is the trie's: the
earliest occurrence of the longest suffix, up to max_ngram tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from cascade_service.core.types import Context

PAIR_CANDIDATES = 64  # a pair's earlier occurrences a lookup compares at most before it reads the trie


class PairIndex:
    """The lookup's light index of the committed tokens: each pair's followers, in order, and each token's
    first follower. A match is the earliest of the longest: the pair's followers (the committed ones, then
    the tail's and the proposal's, read directly) extended leftwards by comparison, up to max_ngram;
    without one, the last token's first follower (a match of one token, which only a virtual extension
    after a longer first match may use)."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.followers: dict[tuple[int, int], list[int]] = {}
        self.first: dict[int, int] = {}
        self.indexed = 0  # follower positions < indexed are in the dicts
        self.ops = 0

    def add(self, tokens: Sequence[int], stable: int) -> None:
        """Index the followers in [indexed, stable) of `tokens` (its committed tokens never change)."""
        if stable > self.indexed:
            first, followers = self.first, self.followers
            for j in range(max(self.indexed, 1), stable):
                first.setdefault(tokens[j - 1], j)
                if j >= 2:
                    followers.setdefault((tokens[j - 2], tokens[j - 1]), []).append(j)
            self.ops += 2 * (stable - self.indexed)
            self.indexed = stable

    def lookup(self, ctx: Context, k: int, min_match: int) -> list[int] | None:
        """What `mag.MaxGram.lookup` returns, or None where a pair recurs too often to compare (read the trie)."""
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
        last pair recurs more than PAIR_CANDIDATES times."""
        cap = min(self.max_ngram, end - 1)
        if cap < 1:
            return -1, 0
        last = seq[end - 1]
        if cap >= 2:
            pair = (seq[end - 2], last)
            committed = self.followers.get(pair, ())
            if len(committed) > PAIR_CANDIDATES:
                return None
            scan = range(max(self.indexed, 2), end)  # the tail's and the proposal's followers: a few
            tail = [j for j in scan if seq[j - 2] == pair[0] and seq[j - 1] == last]
            self.ops += len(scan)
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
