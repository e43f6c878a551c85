"""Max-Gram (MaG): the statistical drafter at the bottom of the cascade (CS Drafting §3.3).

MaG proposes the tokens that followed the longest suffix of the sequence seen earlier in it, and fills
what is left from a bigram table. The authors' mag.py searched the prompt first, then the generated
text, then filled with the bigram table; taking the earliest occurrence of the longest match keeps that
order, since the prompt comes first in the sequence.

Deviation (ours): the paper rescans the sequence on every call; here the committed prefix
`ctx.tokens[:ctx.stable]` is indexed once, incrementally, so a call costs O(new tokens + tail + k),
times `max_ngram`, whatever the sequence length. The pending tail (which may change between calls)
gets a throwaway overlay index built per call over the tail and the tokens proposed so far.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from cascade_service.core.types import Context

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


class _Sequence:
    """The request's tokens followed by this call's proposals, without copying the long prefix."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.extra: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens) + len(self.extra)

    def __getitem__(self, i: int) -> int:
        n = len(self.tokens)
        return self.tokens[i] if i < n else self.extra[i - n]

    def span(self, start: int, stop: int) -> list[int]:
        return [self[i] for i in range(start, stop)]


class _Trie:
    """N-grams read right to left: node (parent, token) extends its parent's n-gram one token leftwards.

    Each node keeps the position of the token that followed the n-gram's earliest occurrence. Keys are
    pairs, so adding or looking up an n-gram costs one dict operation per length, not one per token.
    An overlay (base given) adds nodes on top of a base trie without changing it.
    """

    def __init__(self, max_ngram: int, base: _Trie | None = None):
        self.max_ngram = max_ngram
        self.base = base
        self.edges: dict[tuple[int, int], int] = {}
        self.follow: list[int] = []
        self.first_id: int = 1 if base is None else base.first_id + len(base.follow)  # 0 is the root
        self.ops = 0

    def child(self, node: int, token: int) -> int | None:
        self.ops += 1
        if self.base is not None and node < self.first_id:
            found = self.base.edges.get((node, token))
            if found is not None:
                return found
        return self.edges.get((node, token))

    def follower(self, node: int) -> int:
        if node < self.first_id:
            return self.base.follower(node)  # type: ignore[union-attr]
        return self.follow[node - self.first_id]

    def add(self, seq: _Sequence | list[int], j: int) -> None:
        """Index every n-gram that ends just before position j, with seq[j] as its follower."""
        node = 0
        for n in range(1, min(self.max_ngram, j) + 1):
            nxt = self.child(node, seq[j - n])
            if nxt is None:
                # Later occurrences never overwrite: the earliest one (prompt first) must win.
                nxt = self.first_id + len(self.follow)
                self.edges[(node, seq[j - n])] = nxt
                self.follow.append(j)
                self.ops += 1
            node = nxt

    def longest_match(self, seq: _Sequence) -> int | None:
        """Follower position of the earliest occurrence of seq's longest indexed suffix."""
        return self.match(seq)[0]

    def match(self, seq: _Sequence) -> tuple[int | None, int]:
        """(follower position, length) of seq's longest indexed suffix; (None, 0) if none."""
        node, end, length = 0, len(seq), 0
        for n in range(1, min(self.max_ngram, end - 1) + 1):
            nxt = self.child(node, seq[end - n])
            if nxt is None:
                break  # a longer suffix can't occur if this one doesn't
            node, length = nxt, n
        return (None, 0) if node == 0 else (self.follower(node), length)


class MaxGram:
    """Per-request MaG state: proposes continuations of `ctx.tokens` (paper §3).

    A short proposal is only a match that ran out: asked again, MaG matches the longer sequence
    (`decides_length` False), as the paper's MaG does.

    `index_ops` counts dict lookups and insertions, cumulatively; a call adds
    O((new committed tokens + tail + k) * max_ngram) to it, independent of the sequence length.
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
        # Where the index of a finished request's final tokens goes (runtime.leaves keeps it for a
        # request that continues them, a session's next turn): None, it goes with the request.
        self.keep: Callable[[tuple[int, ...], MaxGram], None] | None = None

    @property
    def index_ops(self) -> int:
        return self._committed.ops + self._tail_ops

    def propose(self, ctx: Context, k: int) -> list[int]:
        """Up to k tokens to follow ctx.tokens: n-gram matches first, then bigram fill; may be empty."""
        seq = self._matched(ctx, k, min_match=1)
        if seq is None:
            return []
        self._fill_from_bigram(seq, k)
        return seq.extra

    def lookup(self, ctx: Context, k: int, min_match: int) -> list[int]:
        """Up to k tokens continuing an earlier occurrence of ctx's last `min_match`+ tokens, else [].

        No bigram fill: this is the confident half of MaG, which the target may review directly
        (`Lookup`), as prompt-lookup decoding does.
        """
        seq = self._matched(ctx, k, min_match)
        return [] if seq is None else seq.extra

    @property
    def indexed(self) -> int:
        """Committed tokens in the index: a request resuming it must start with the same ones."""
        return self._indexed

    def finish(self, tokens: Sequence[int] = ()) -> None:
        """The request is over. Given its final committed `tokens`, the index takes them in and goes to
        `keep`, so a request that continues them reads only its own new tokens."""
        if tokens and self.keep is not None and len(tokens) >= self._indexed:
            self._commit(Context(list(tokens), len(tokens)))
            self.keep(tuple(tokens), self)

    def _matched(self, ctx: Context, k: int, min_match: int) -> _Sequence | None:
        self._commit(ctx)
        if k <= 0:
            return None
        seq = _Sequence(ctx.tokens)
        overlay = _Trie(self.max_ngram, base=self._committed)
        for j in range(max(ctx.stable, 1), len(seq)):
            overlay.add(seq, j)
        try:
            if overlay.match(seq)[1] < min_match:
                return seq if min_match <= 1 else None
            self._extend_by_matches(seq, overlay, k)
        finally:
            self._tail_ops += overlay.ops
        return seq

    def _commit(self, ctx: Context) -> None:
        if not 0 <= ctx.stable <= len(ctx.tokens):
            raise ValueError(f"ctx.stable = {ctx.stable} is outside [0, {len(ctx.tokens)}]")
        if ctx.stable < self._indexed:
            raise ValueError(
                f"ctx.stable shrank from {self._indexed} to {ctx.stable}: committed tokens never "
                "change within a request; use a new MaxGram per request"
            )
        for j in range(max(self._indexed, 1), ctx.stable):
            self._committed.add(ctx.tokens, j)
        self._indexed = ctx.stable

    def _extend_by_matches(self, seq: _Sequence, overlay: _Trie, k: int) -> None:
        # Matching the virtual sequence (tokens + proposals) lets a match that runs into the end of
        # the sequence carry on, e.g. repeating a period; the overlay dies with this call.
        while len(seq.extra) < k:
            start = overlay.longest_match(seq)
            if start is None:
                return
            end = len(seq)
            take = seq.span(start, min(end, start + k - len(seq.extra)))
            seq.extra.extend(take)
            for j in range(end, len(seq)):
                overlay.add(seq, j)

    def _fill_from_bigram(self, seq: _Sequence, k: int) -> None:
        if self.bigram is None:
            return
        while len(seq.extra) < k and len(seq):
            nxt = self.bigram.next(seq[len(seq) - 1])
            if nxt is None:
                return
            seq.extra.append(nxt)
