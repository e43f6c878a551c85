"""The statistical drafters of a wiring (MaG, suffix decoding): their tables, loaded once, and one
request's tiers of them, built one way for every wiring.

`LEAVES` is the family's registry: a config kind -> the class that holds that kind's state for a
wiring (MaG: its bigram table; suffix decoding: its caches of recent requests, one per API key, and
the shared corpus) and makes a request's proposer from it. `Leaves` holds one of them per statistical
drafter of a config that runs in this process (MaG on a tier server of its own is reached as a model
tier is).
"""

from __future__ import annotations

import copy
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import ConfigError, MaGConfig, StatisticalConfig, SuffixConfig
from ..core.local import Proposer, StatisticalTier
from ..core.proposers.mag import BigramTable, MaxGram
from ..core.proposers.suffix import SuffixCache, SuffixDecoder, SuffixSettings, TenantCaches, corpus_cache
from ..core.tier import Tier

Encode = Callable[[str], list[int]]
MAX_KEPT_TOKENS = 200_000  # finished requests' tokens whose drafters' indexes are kept, in all (KeptIndexes)
MAX_KEPT = 256  # and at most this many (a lookup compares each one's owner and length)


class KeptIndexes:
    """Statistical drafters' per-request indexes (MaG's n-gram trie, suffix decoding's own trie) of
    finished requests' final tokens, per API key, for requests that continue them (a session's next
    turn, a chat client resending its conversation): such a request indexes only its new tokens, where
    it would otherwise index its whole history (a 4,000-token context: 0.13 s for MaG, 0.16 s for
    suffix decoding on this CPU, before its first draft). Least recently used first to go past
    `max_tokens` in all; an index is taken by one request (it grows with it) and kept again at its end.

    Every request asks, so a kept sequence is filed under its key and its first OPENING tokens: a
    request compares only the sequences that open as its context does. Comparing it with every kept
    one took 388 us a request with the store full (256 sequences of 500-760 tokens), 1.5% of the
    engine's time at 64 streams on the 2-core host, for requests that mostly rest (docs/algorithm.md)."""

    OPENING = 8

    def __init__(self, max_tokens: int = MAX_KEPT_TOKENS, max_entries: int = MAX_KEPT):
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._kept: OrderedDict[tuple[str, tuple[int, ...]], Any] = OrderedDict()
        self._filed: dict[tuple[str, tuple[int, ...]], set[tuple[int, ...]]] = {}  # (owner, opening) -> sequences
        self._tokens = 0
        self._lock = threading.Lock()

    def take(self, owner: str, context: Sequence[int]) -> Any:
        """The kept index of `owner`'s longest finished sequence that `context` starts with."""
        with self._lock:
            if not self._kept:
                return None
            best: tuple[int, ...] | None = None
            n = len(context)
            # A sequence shorter than OPENING is filed under all of itself: one opening per length.
            for length in range(min(self.OPENING, n) + 1):
                for tokens in self._filed.get((owner, tuple(context[:length])), ()):
                    size = len(tokens)
                    if size > n or (best is not None and size <= len(best)):
                        continue
                    if (not size or context[size - 1] == tokens[-1]) and tuple(context[:size]) == tokens:
                        best = tokens
            if best is None:
                return None
            return self._drop((owner, best))

    def put(self, owner: str, tokens: tuple[int, ...], index: Any) -> None:
        with self._lock:
            key = (owner, tokens)
            if key in self._kept:
                self._drop(key)
            self._kept[key] = index
            self._filed.setdefault((owner, tokens[: self.OPENING]), set()).add(tokens)
            self._tokens += len(tokens)
            while (self._tokens > self.max_tokens or len(self._kept) > self.max_entries) and self._kept:
                self._drop(next(iter(self._kept)))

    def _drop(self, key: tuple[str, tuple[int, ...]]) -> Any:
        owner, tokens = key
        opening = (owner, tokens[: self.OPENING])
        filed = self._filed[opening]
        filed.discard(tokens)
        if not filed:
            del self._filed[opening]
        self._tokens -= len(tokens)
        return self._kept.pop(key)

    def __len__(self) -> int:
        return len(self._kept)


class MaGLeaf:
    """MaG for a wiring: its bigram table, and the indexes of finished requests (`KeptIndexes`)."""

    def __init__(self, config: MaGConfig, encode: Encode | None = None):
        self.config = config
        self.bigram = BigramTable.load(config.bigram) if config.bigram else None
        self.kept = KeptIndexes()

    def proposer(self, owner: str, context: Sequence[int] = ()) -> Proposer:
        index = self.kept.take(owner, context) or MaxGram(self.bigram, self.config.max_ngram)
        index.keep = functools.partial(self.kept.put, owner)
        return index

    def forget(self) -> None:
        self.kept = KeptIndexes(self.kept.max_tokens)

    def fresh(self) -> MaGLeaf:
        """The same bigram table, no requests' indexes."""
        twin = copy.copy(self)
        twin.kept = KeptIndexes(self.kept.max_tokens)
        return twin


class SuffixLeaf:
    """Suffix decoding for a wiring: each API key's recent requests (core.proposers.suffix.TenantCaches) and the
    operator's corpus, read and indexed once here (with `encode`, the target's tokenizer)."""

    def __init__(self, config: SuffixConfig, encode: Encode | None = None):
        self.config = config
        settings = SuffixSettings(config.depth, config.factor, config.min_prob, config.cache_tokens)
        self.caches = TenantCaches(settings, config.total_cache_tokens)
        self.kept = KeptIndexes()
        self.corpus: SuffixCache | None = None
        if config.corpus is not None:
            if encode is None:
                raise ConfigError(f"{config.name}.corpus: this wiring has no tokenizer to read it with")
            self.corpus = corpus_cache(settings, [_corpus_tokens(config, encode)])

    def proposer(self, owner: str, context: Sequence[int] = ()) -> Proposer:
        decoder = self.kept.take(owner, context) or SuffixDecoder(self.caches.of(owner), self.corpus)
        decoder.keep = functools.partial(self.kept.put, owner)
        return decoder

    def forget(self) -> None:
        self.caches.clear()
        self.kept = KeptIndexes(self.kept.max_tokens)

    def fresh(self) -> SuffixLeaf:
        """The same settings and corpus (read once), no recent requests."""
        twin = copy.copy(self)
        twin.caches = TenantCaches(self.caches.settings, self.config.total_cache_tokens)
        twin.kept = KeptIndexes(self.kept.max_tokens)
        return twin


Leaf = MaGLeaf | SuffixLeaf
LEAVES: dict[str, Callable[..., Leaf]] = {MaGConfig.kind: MaGLeaf, SuffixConfig.kind: SuffixLeaf}


class Leaves:
    """The statistical drafters of a config that run in this process, with their wiring-wide state."""

    def __init__(
        self, drafters: Sequence[object], vocab_size: int, encode: Encode | None = None, like: Leaves | None = None
    ):
        """`like`: another wiring's leaves whose tables (bigram tables, corpora) are reused where the
        config is the same, with none of its requests (an engine's variants: tune tries hundreds)."""
        self.vocab_size = vocab_size
        known = {leaf.config: leaf for leaf in like.leaves.values()} if like is not None else {}
        self.leaves: dict[str, Leaf] = {
            d.name: known[d].fresh() if d in known else LEAVES[d.kind](d, encode)
            for d in drafters
            if isinstance(d, StatisticalConfig) and not d.remote
        }

    def __call__(self, owner: str, context: Sequence[int] = ()) -> dict[str, Tier]:
        """One request's tiers of them, for the API key `owner` ("" without keys) and its `context`
        (MaG resumes a finished request's index that it continues)."""
        return {
            name: StatisticalTier(leaf.proposer(owner, context), self.vocab_size, name)
            for name, leaf in self.leaves.items()
        }

    def __contains__(self, name: str) -> bool:
        return name in self.leaves

    def suffix(self, name: str) -> TenantCaches:
        """The caches of suffix drafter `name` (tests and the bench look into them)."""
        leaf = self.leaves[name]
        if not isinstance(leaf, SuffixLeaf):
            raise ValueError(f"{name!r} is not a suffix drafter")
        return leaf.caches

    def forget(self) -> None:
        """Drop every cross-request state (a benchmark's next repeat must not find its own outputs)."""
        for leaf in self.leaves.values():
            leaf.forget()


def _corpus_tokens(config: SuffixConfig, encode: Encode) -> list[int]:
    assert config.corpus is not None
    try:
        text = Path(config.corpus).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config.name}.corpus: cannot read {config.corpus}: {exc}") from None
    tokens = encode(text)
    if len(tokens) > config.corpus_tokens:
        raise ConfigError(
            f"{config.name}.corpus: {config.corpus} holds {len(tokens)} tokens, more than corpus_tokens "
            f"({config.corpus_tokens}); raise it or shorten the corpus"
        )
    return tokens
