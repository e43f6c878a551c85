"""Max-Gram (MaG): the statistical drafter at the bottom of the cascade (CS Drafting §3.3).

MaG proposes the tokens that followed the longest suffix of the sequence seen earlier in it, and fills
what is left from a bigram table. The authors' mag.py searched the prompt first, then the generated
text, then filled with the bigram table; taking the earliest occurrence of the longest match keeps that
order, since the prompt comes first in the sequence.

Deviation (ours): the paper rescans the sequence on every call; here the committed prefix
`ctx.tokens[:ctx.stable]` is indexed once, incrementally, so a call costs O(new tokens + tail + k),
times `max_ngram`, whatever the sequence length. The pending tail (which may change between calls)
gets a throwaway overlay index built per call over the tail and the tokens proposed so far.

Deviation (ours, on cost only): a call reads a lighter index first (`pairs.PairIndex`): each committed
token pair's followers and each token's first follower, four dict operations on ints a token against the
trie's two per length, each match extended leftwards by comparing tokens. Under load at T = 1 the floor asks the
lookup every round and drafts almost nothing, and indexing a 550-token prompt in the trie cost 2.6 ms of
Python a request; with the pairs, 0.57 ms for the prompt and 64 lookups. Where a pair has more than
PAIR_CANDIDATES earlier occurrences (a long run of one token), the trie is built and answers from then
on, so no call compares more than that many occurrences. Both find what the paper's rule finds.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from cascade_service.core.types import Context

from .pairs import PairIndex

BIGRAM_FORMAT = "cascade-service/bigram-v1"
_CHUNK = 1 << 22  # tokens per bincount chunk: bounds memory while keeping torch calls large


class BigramTable:
    """The most likely next token for each token, counted from a token stream (paper §3 fallback)."""

    def __init__(self, vocab_size: int, next_tokens: Sequence[int]):
        if len(next_tokens) != vocab_size:
            raise ValueError(f"bigram table needs {vocab_size} entries, got {len(next_tokens)}")
        self.vocab_size = vocab_size
        self._next = [int(t) for t in next_tokens]  # -1: never seen as a predecessor

    @classmethod
    def from_tokens(cls, stream: Iterable[int], vocab_size: int) -> BigramTable:
        """Count bigrams in `stream`; ties between followers go to the smallest token id."""
        keys, counts = _count_pairs(_chunks(stream), vocab_size)
        prev, follower = keys // vocab_size, keys % vocab_size
        # Order by (prev asc, count desc, follower asc): keys arrive sorted by (prev, follower), and
        # stable sorts keep that order among equals, so the first row of each prev group wins.
        order = torch.sort(counts, descending=True, stable=True).indices
        order = order[torch.sort(prev[order], stable=True).indices]
        prev, follower = prev[order], follower[order]
        first = torch.ones_like(prev, dtype=torch.bool)
        first[1:] = prev[1:] != prev[:-1]
        table = torch.full((vocab_size,), -1, dtype=torch.int64)
        table[prev[first]] = follower[first]
        return cls(vocab_size, table.tolist())

    def next(self, token: int) -> int | None:
        """The most likely follower of `token`, or None if it was never seen as a predecessor."""
        if not 0 <= token < self.vocab_size:
            return None
        nxt = self._next[token]
        return None if nxt < 0 else nxt

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (never pickle: tables travel between machines)."""
        doc = {"format": BIGRAM_FORMAT, "vocab_size": self.vocab_size, "next": self._next}
        Path(path).write_text(json.dumps(doc, separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> BigramTable:
        """Read a table written by `save`; raise ValueError on anything else."""
        try:
            doc = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a bigram table (invalid JSON: {e})") from None
        if not isinstance(doc, dict) or doc.get("format") != BIGRAM_FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"{path}: expected format {BIGRAM_FORMAT!r}, got {got!r}")
        vocab, nxt = doc.get("vocab_size"), doc.get("next")
        if type(vocab) is not int or vocab <= 0:
            raise ValueError(f"{path}: vocab_size must be a positive integer, got {vocab!r}")
        if not isinstance(nxt, list) or len(nxt) != vocab:
            raise ValueError(f"{path}: 'next' must be a list of {vocab} token ids")
        if any(type(t) is not int or not -1 <= t < vocab for t in nxt):
            raise ValueError(f"{path}: 'next' entries must be token ids in [0, {vocab}) or -1")
        return cls(vocab, nxt)


def _chunks(stream: Iterable[int]) -> Iterable[torch.Tensor]:
    if isinstance(stream, torch.Tensor):
        yield from stream.reshape(-1).to(torch.int64).split(_CHUNK)
        return
    it = iter(stream)
    while chunk := list(itertools.islice(it, _CHUNK)):
        yield torch.tensor(chunk, dtype=torch.int64)


def _count_pairs(chunks: Iterable[torch.Tensor], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique keys prev * vocab + next with their counts, never a dense vocab x vocab table."""
    keys = counts = torch.zeros(0, dtype=torch.int64)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    carry = torch.zeros(0, dtype=torch.int64)  # the last token of the previous chunk
    for chunk in chunks:
        if chunk.numel() and (chunk.min() < 0 or chunk.max() >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab})")
        seq = torch.cat([carry, chunk])
        carry = seq[-1:]
        if seq.numel() >= 2:
            pending.append(torch.unique(seq[:-1] * vocab + seq[1:], return_counts=True))
        # Merge only when the pending pairs outgrow the merged ones, so merging stays amortised.
        if sum(k.numel() for k, _ in pending) >= keys.numel():
            keys, counts = _merge([(keys, counts), *pending])
            pending = []
    return _merge([(keys, counts), *pending])


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.cat([k for k, _ in parts])
    counts = torch.cat([c for _, c in parts])
    uniq, inverse = torch.unique(keys, return_inverse=True)
    return uniq, torch.zeros_like(uniq).scatter_add_(0, inverse, counts)


def _span(tokens: list[int], proposal: list[int], start: int, stop: int) -> list[int]:
    """(tokens + proposal)[start:stop], without copying `tokens`."""
    n = len(tokens)
    if stop <= n:
        return tokens[start:stop]
    if start >= n:
        return proposal[start - n : stop - n]
    return tokens[start:] + proposal[: stop - n]


_KEY = 1 << 32  # an edge's key: parent node * _KEY + token (an int: no tuple to build or hash per step)


class _Trie:
    """N-grams read right to left: node (parent, token) extends its parent's n-gram one token leftwards.

    Each node keeps the position of the token that followed the n-gram's earliest occurrence. Adding or
    looking up an n-gram costs one dict operation per length, not one per token. An overlay (base
    given) adds nodes on top of a base trie without changing it.

    Sequences are read through a window: `seq[i - offset]` is the sequence's token i, and `seq` holds at
    least max_ngram tokens before the first position indexed or matched, so a call never copies the
    long prefix it does not read.
    """

    def __init__(self, max_ngram: int, base: _Trie | None = None):
        self.max_ngram = max_ngram
        self.base = base
        self.edges: dict[int, int] = {}
        self.follow: list[int] = []
        self.first_id: int = 1 if base is None else base.first_id + len(base.follow)  # 0 is the root
        self.ops = 0

    def follower(self, node: int) -> int:
        if node < self.first_id:
            return self.base.follower(node)  # type: ignore[union-attr]
        return self.follow[node - self.first_id]

    def add(self, seq: Sequence[int], offset: int, lo: int, hi: int) -> None:
        """For every position j in [lo, hi), index each n-gram that ends just before j, j its follower."""
        # One tight loop with everything local: MaG indexes every committed token (a 700-token prompt
        # is 11,000 steps at max_ngram 16), on the round's critical path.
        edges, follow, first, max_ngram = self.edges, self.follow, self.first_id, self.max_ngram
        base = self.base.edges if self.base is not None else None
        new, ops = first + len(follow), 0
        for j in range(max(lo, 1), hi):
            node = 0
            for n in range(1, min(max_ngram, j) + 1):
                key = node * _KEY + seq[j - n - offset]
                nxt = base.get(key) if base is not None and node < first else None
                if nxt is None:
                    nxt = edges.get(key)
                    if nxt is None:
                        # Later occurrences never overwrite: the earliest one (prompt first) must win.
                        nxt = edges[key] = new
                        new += 1
                        follow.append(j)
                        ops += 1
                ops += 1
                node = nxt
        self.ops += ops

    def match(self, seq: Sequence[int], offset: int, end: int) -> tuple[int | None, int]:
        """(follower position, length) of the longest indexed suffix of the sequence's first `end`
        tokens; (None, 0) if none."""
        edges, first = self.edges, self.first_id
        base = self.base.edges if self.base is not None else None
        node, length = 0, 0
        for n in range(1, min(self.max_ngram, end - 1) + 1):
            key = node * _KEY + seq[end - n - offset]
            self.ops += 1
            nxt = base.get(key) if base is not None and node < first else None
            if nxt is None:
                nxt = edges.get(key)
            if nxt is None:
                break  # a longer suffix can't occur if this one doesn't
            node, length = nxt, n
        return (None, 0) if node == 0 else (self.follower(node), length)


class MaxGram:
    """Per-request MaG state: proposes continuations of `ctx.tokens` (paper §3).

    A short proposal is only a match that ran out: asked again, MaG matches the longer sequence
    (`decides_length` False), as the paper's MaG does.

    `index_ops` counts dict lookups and insertions and token comparisons, cumulatively; a call adds
    O((new committed tokens + tail + k) * max_ngram + k * (tail + k + pairs.PAIR_CANDIDATES * max_ngram)) to it,
    independent of the sequence length.
    """

    decides_length = False

    def __init__(self, bigram: BigramTable | None = None, max_ngram: int = 16):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be at least 1, got {max_ngram}")
        self.bigram = bigram
        self.max_ngram = max_ngram
        self._committed = _Trie(max_ngram)
        self._indexed = 0  # follower positions < _indexed are in the committed trie
        self._tail_ops = 0
        self._pairs = PairIndex(max_ngram)  # read first, until a pair recurs too often and the trie answers
        # Where the index of a finished request's final tokens goes (engine.leaves keeps it for a
        # request that continues them, a session's next turn): None, it goes with the request.
        self.keep: Callable[[tuple[int, ...], MaxGram], None] | None = None

    @property
    def index_ops(self) -> int:
        return self._committed.ops + self._tail_ops + self._pairs.ops

    def propose(self, ctx: Context, k: int) -> list[int]:
        """Up to k tokens to follow ctx.tokens: n-gram matches first, then bigram fill; may be empty."""
        proposal = self._from_pairs(ctx, k, 1)
        if proposal is None:
            proposal = self._matched(ctx, k, min_match=1)
        if proposal is None:
            return []
        self._fill_from_bigram(ctx.tokens, proposal, k)
        return proposal

    def lookup(self, ctx: Context, k: int, min_match: int) -> list[int]:
        """Up to k tokens continuing an earlier occurrence of ctx's last `min_match`+ tokens, else [].

        No bigram fill: this is the confident half of MaG, which the target may review directly
        (`Lookup`), as prompt-lookup decoding does.
        """
        proposal = self._from_pairs(ctx, k, min_match)
        if proposal is None:
            proposal = self._matched(ctx, k, min_match)
        return [] if proposal is None else proposal

    def _from_pairs(self, ctx: Context, k: int, min_match: int) -> list[int] | None:
        """The matches from the light index, or None where the trie must answer (it is built already, or
        the last pair recurs too often to compare)."""
        if self._indexed > 0:
            return None
        self._check_stable(ctx, self._pairs.indexed)
        return self._pairs.lookup(ctx, k, min_match)

    @property
    def indexed(self) -> int:
        """Committed tokens in the index: a request resuming it must start with the same ones."""
        return max(self._indexed, self._pairs.indexed)

    def finish(self, tokens: Sequence[int] = ()) -> None:
        """The request is over. Given its final committed `tokens`, the index takes them in and goes to
        `keep`, so a request that continues them reads only its own new tokens. An index the request
        never read (its rounds never asked MaG: the floor kept it off) is not built now either: a
        request that continues may build its own when it needs one. Of the two indexes, the one the
        lookups read takes the tokens in (the trie, once built, serves every call)."""
        if tokens and self.keep is not None and 0 < self.indexed <= len(tokens):
            if self._indexed > 0:
                self._commit(Context(list(tokens), len(tokens)))
            else:
                self._pairs.add(tokens, len(tokens))
            self.keep(tuple(tokens), self)

    def _matched(self, ctx: Context, k: int, min_match: int) -> list[int] | None:
        """The proposal so far (matches only); None where a lookup's match is shorter than min_match."""
        self._commit(ctx)
        if k <= 0:
            return None
        tokens, end = ctx.tokens, len(ctx.tokens)
        # The window the overlay reads: the pending tail, the proposals, and max_ngram tokens before them.
        offset = max(0, min(ctx.stable, end) - self.max_ngram - 1)
        window = tokens[offset:]
        overlay = _Trie(self.max_ngram, base=self._committed)
        overlay.add(window, offset, max(ctx.stable, 1), end)
        proposal: list[int] = []
        try:
            if overlay.match(window, offset, end)[1] < min_match:
                return proposal if min_match <= 1 else None
            # Matching the virtual sequence (tokens + proposals) lets a match that runs into the end of
            # the sequence carry on, e.g. repeating a period; the overlay dies with this call.
            while len(proposal) < k:
                start = overlay.match(window, offset, end)[0]
                if start is None:
                    break
                stop = min(end, start + k - len(proposal))
                take = _span(tokens, proposal, start, stop)
                proposal += take
                window += take
                overlay.add(window, offset, end, end + len(take))
                end += len(take)
        finally:
            self._tail_ops += overlay.ops
        return proposal

    @staticmethod
    def _check_stable(ctx: Context, seen: int) -> None:
        """ctx.stable must lie within the tokens and never fall below the `seen` committed tokens."""
        if not 0 <= ctx.stable <= len(ctx.tokens):
            raise ValueError(f"ctx.stable = {ctx.stable} is outside [0, {len(ctx.tokens)}]")
        if ctx.stable < seen:
            raise ValueError(
                f"ctx.stable shrank from {seen} to {ctx.stable}: committed tokens never "
                "change within a request; use a new MaxGram per request"
            )

    def _commit(self, ctx: Context) -> None:
        self._check_stable(ctx, max(self._indexed, self._pairs.indexed))
        self._committed.add(ctx.tokens, 0, self._indexed, ctx.stable)
        self._indexed = ctx.stable

    def _fill_from_bigram(self, tokens: list[int], proposal: list[int], k: int) -> None:
        if self.bigram is None:
            return
        last = proposal[-1] if proposal else (tokens[-1] if tokens else None)
        while len(proposal) < k and last is not None:
            nxt = self.bigram.next(last)
            if nxt is None:
                return
            proposal.append(nxt)
            last = nxt
