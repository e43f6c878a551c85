"""The statistical leaves of a cascade (MaG, suffix decoding) for one request, built one way for the
engine and the coordinator.

MaG needs only the bigram table the wiring loaded. Suffix decoding also keeps the sequences of
recent requests (core.suffix.SuffixCache): one cache per wiring (an engine, a coordinator), shared by
its concurrent requests, made here from the config."""

from __future__ import annotations

from ..config import CascadeConfig, MaGConfig, SuffixConfig
from ..core.local import MaGTier
from ..core.mag import BigramTable, MaxGram
from ..core.suffix import SuffixCache, SuffixDecoder, SuffixSettings


def suffix_caches(cascade: CascadeConfig) -> dict[str, SuffixCache]:
    """One global suffix cache per suffix drafter of the config."""
    return {
        d.name: SuffixCache(SuffixSettings(d.depth, d.factor, d.min_prob, d.cache_tokens))
        for d in cascade.drafters
        if isinstance(d, SuffixConfig)
    }


def statistical_tier(
    config: MaGConfig, bigram: BigramTable | None, vocab_size: int, caches: dict[str, SuffixCache]
) -> MaGTier:
    """This request's tier of a statistical drafter: MaG's n-gram index, or a suffix decoder."""
    if isinstance(config, SuffixConfig):
        return MaGTier(SuffixDecoder(caches[config.name]), vocab_size, config.name)
    return MaGTier(MaxGram(bigram, config.max_ngram), vocab_size, config.name)
