"""Suffix decoding (core.proposers.suffix): counts, longest match, most frequent continuation, the confidence
and length rules, the request's own trie grown incrementally, the bounded global cache."""

import random
from collections import Counter

import pytest

from cascade_service.core.proposers.suffix import (
    SuffixCache,
    SuffixDecoder,
    SuffixSettings,
    SuffixTrie,
    TenantCaches,
    _Growing,
    corpus_cache,
)
from cascade_service.core.types import Context


def committed(tokens, tail=()):
    return Context(list(tokens) + list(tail), len(tokens))


def naive_counts(sequences, depth):
    """Occurrences of every substring up to `depth` long, written plainly."""
    counts = Counter()
    for seq in sequences:
        for i in range(len(seq)):
            for n in range(1, depth + 1):
                if i + n <= len(seq):
                    counts[tuple(seq[i : i + n])] += 1
    return counts


def test_trie_counts_every_substring_up_to_its_depth():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(30)] for _ in range(3)]
    trie = SuffixTrie(depth=5)
    for seq in seqs:
        trie.add(seq)
    expected = naive_counts(seqs, 5)
    assert trie.nodes == len(expected)
    for substring, count in expected.items():
        assert trie.count[trie.walk(substring)] == count, substring
    assert trie.walk([9]) == -1


def test_growing_trie_equals_the_trie_of_the_whole_sequence():
    rng = random.Random(1)
    seq = [rng.randrange(5) for _ in range(60)]
    grown, whole = _Growing(depth=6), SuffixTrie(depth=6)
    for token in seq:
        grown.append(token)
    whole.add(seq)
    assert grown.nodes == whole.nodes
    for substring, count in naive_counts([seq], 6).items():
        assert grown.count[grown.walk(substring)] == count


def test_the_most_frequent_continuation_of_the_longest_match_is_drafted():
    # "1 2" is followed by 3 twice and by 4 once; the draft follows 3 and keeps following the most
    # frequent continuation while its estimated probability stays above min_prob.
    cache = SuffixCache(SuffixSettings(depth=8, factor=4.0, min_prob=0.1, cache_tokens=0))
    drafter = SuffixDecoder(cache)
    history = [1, 2, 3, 5, 9, 1, 2, 3, 5, 9, 1, 2, 4, 7, 1, 2]
    assert drafter.propose(committed(history), 4) == [3, 5, 9, 1]
    assert drafter.matched == 2


def test_confidence_and_match_length_bound_the_draft():
    history = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]  # after "1 2": 3, 4 or 5, one third each
    strict = SuffixDecoder(SuffixCache(SuffixSettings(depth=8, factor=4.0, min_prob=0.5, cache_tokens=0)))
    assert strict.propose(committed(history), 8) == []  # 1/3 < min_prob: no guess
    short = SuffixDecoder(SuffixCache(SuffixSettings(depth=16, factor=0.5, min_prob=0.0, cache_tokens=0)))
    assert short.propose(committed([7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]), 8) == [9, 7, 8, 9]  # 0.5 x match length
    assert short.matched == 8


def test_a_draft_goes_on_past_the_tries_depth():
    # Depth 4: a path ends after 4 tokens, so drafting re-anchors on the sequence with the draft so far.
    deep = SuffixDecoder(SuffixCache(SuffixSettings(depth=4, factor=4.0, min_prob=0.0, cache_tokens=0)))
    assert deep.propose(committed([7, 8, 9] * 4), 9) == [7, 8, 9] * 3
    assert deep.matched == 3


def test_pending_tail_is_matched_but_not_indexed():
    drafter = SuffixDecoder(SuffixCache(SuffixSettings(depth=8, factor=4.0, cache_tokens=0)))
    drafter.propose(committed([1, 2, 3, 4], tail=[1, 2]), 2)
    assert drafter.own.walk([4, 1]) == -1  # the tail may still be rejected: not in the request's trie
    assert drafter.propose(committed([1, 2, 3, 4], tail=[1, 2]), 2) == [3, 4]


def test_finished_requests_teach_the_next_and_the_cache_stays_bounded():
    cache = SuffixCache(SuffixSettings(depth=6, factor=4.0, min_prob=0.1, cache_tokens=80))
    first = SuffixDecoder(cache)
    first.propose(committed([5, 6, 7, 8, 9, 10]), 1)
    first.finish()
    assert SuffixDecoder(cache).propose(committed([0, 5, 6]), 3) == [7, 8, 9]  # learnt from the first
    sizes = []
    for i in range(40):
        d = SuffixDecoder(cache)
        d.propose(committed([100 + i + j for j in range(20)]), 1)
        d.finish()
        sizes.append(cache.nodes)
    assert cache.held_tokens <= 80 and max(sizes) <= naive_unique_bound(80, 6)
    assert SuffixDecoder(cache).propose(committed([0, 5, 6]), 3) == []  # the first has been forgotten
    cache.clear()
    assert cache.nodes == 0


def naive_unique_bound(length, depth):
    return sum(max(0, length - n + 1) for n in range(1, depth + 1))


def test_lookup_drafts_only_on_a_long_enough_match():
    drafter = SuffixDecoder(SuffixCache(SuffixSettings(depth=8, factor=4.0, cache_tokens=0)))
    assert drafter.lookup(committed([1, 2, 3, 9, 2, 3]), 4, min_match=2) == [9, 2, 3, 9]
    assert drafter.lookup(committed([1, 2, 3, 9, 8, 3]), 4, min_match=2) == []


def test_depth_below_two_is_refused():
    with pytest.raises(ValueError, match="depth must be at least 2"):
        SuffixTrie(1)


# ---- one key's memory (invariant 8) ---------------------------------------------------------------


def test_each_key_has_its_own_cache_of_finished_requests():
    caches = TenantCaches(SuffixSettings(depth=8, cache_tokens=100), total_tokens=1000)
    seen = [1, 2, 3, 4, 5, 6, 7, 8]
    alice = SuffixDecoder(caches.of("alice"))
    alice.propose(Context(seen, len(seen)), 1)
    alice.finish()
    assert caches.of("alice").draft([1, 2, 3], 3)[0] == [4, 5, 6]
    assert caches.of("bob").draft([1, 2, 3], 3)[0] == []  # bob never sent it
    assert SuffixDecoder(caches.of("bob")).propose(Context([1, 2, 3], 3), 3) == []


def test_the_least_recently_used_keys_go_when_all_keys_hold_too_much():
    caches = TenantCaches(SuffixSettings(depth=4, cache_tokens=10), total_tokens=25)
    for owner in ("a", "b", "c"):
        caches.of(owner).remember(list(range(10)))
    # 30 tokens held > 25: "a", the least recently used, went; the others stay
    assert caches.owners() == ["b", "c"] and caches.held_tokens == 20
    caches.of("b")  # b used again: c is now the oldest
    caches.of("d").remember(list(range(10)))
    assert caches.owners() == ["b", "d"]
    assert caches.of("a").held_tokens == 0  # a comes back empty


def test_a_corpus_drafts_for_every_key_and_is_never_written():
    settings = SuffixSettings(depth=8, cache_tokens=100)
    corpus = corpus_cache(settings, [[9, 8, 7, 6, 5, 4]])
    caches = TenantCaches(settings, total_tokens=1000)
    for owner in ("alice", "bob"):
        decoder = SuffixDecoder(caches.of(owner), corpus)
        assert decoder.propose(Context([0, 9, 8], 3), 3) == [7, 6]  # factor 1 x a 2-token match
        decoder.finish()
    assert corpus.held_tokens == 6
