"""MaG's index of a finished request is kept for a request that continues it (engine.leaves.KeptIndexes):
the continuing request proposes exactly what a fresh index would, indexing only its new tokens; an
index is found only under its own API key, and the store stays within its token bound."""

from __future__ import annotations

import random

from cascade_service.config import MaGConfig
from cascade_service.core.proposers.mag import MaxGram
from cascade_service.core.types import Context
from cascade_service.engine.leaves import KeptIndexes, MaGLeaf


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(12) for _ in range(n)]  # a small alphabet: many repeated n-grams


def test_a_continuing_request_resumes_the_index_and_proposes_as_a_fresh_one():
    leaf = MaGLeaf(MaGConfig())
    history = _tokens(400, seed=1)
    first = leaf.proposer("alice", history[:300])
    first.propose(Context(history[:300], 300), 5)
    first.finish(history)  # the request ended with `history` committed
    assert len(leaf.kept) == 1
    context = history + _tokens(30, seed=2)
    resumed = leaf.proposer("alice", context)
    assert resumed is first and len(leaf.kept) == 0  # taken by one request at a time
    fresh = MaxGram()
    before_resumed, before_fresh = resumed.index_ops, fresh.index_ops
    for end in range(len(context) - 20, len(context) + 1, 5):
        ctx = Context(context[:end], end - 3)
        assert resumed.propose(ctx, 6) == fresh.propose(ctx, 6)
        assert resumed.lookup(ctx, 6, 2) == fresh.lookup(ctx, 6, 2)
    # The resumed index read only the new tokens; the fresh one the whole history too.
    assert resumed.index_ops - before_resumed < (fresh.index_ops - before_fresh) / 4


def test_a_lookup_only_index_is_kept_and_resumed_as_well():
    # Lookups alone read MaG's light pair index (core.proposers.pairs), not the trie: that one is kept.
    leaf = MaGLeaf(MaGConfig())
    history = _tokens(400, seed=6)
    first = leaf.proposer("alice", history[:300])
    first.lookup(Context(history[:300], 300), 5, 2)
    first.finish(history)
    context = history + _tokens(30, seed=7)
    resumed = leaf.proposer("alice", context)
    assert resumed is first and resumed.indexed == len(history)
    fresh = MaxGram()
    before_resumed, before_fresh = resumed.index_ops, fresh.index_ops
    for end in range(len(context) - 20, len(context) + 1, 5):
        ctx = Context(context[:end], end - 3)
        assert resumed.lookup(ctx, 6, 2) == fresh.lookup(ctx, 6, 2)
    assert resumed.index_ops - before_resumed < (fresh.index_ops - before_fresh) / 4


def test_an_index_is_found_only_under_its_key_and_for_a_context_that_continues_it():
    leaf = MaGLeaf(MaGConfig())
    history = _tokens(100, seed=3)
    unused = leaf.proposer("alice", history)
    unused.finish(history)  # never read during its request (the floor kept MaG off): nothing built, nothing kept
    assert len(leaf.kept) == 0 and unused.index_ops == 0
    index = leaf.proposer("alice", history)
    index.lookup(Context(history[:90], 90), 4, 2)
    index.finish(history)
    assert isinstance(leaf.proposer("bob", history + [1]), MaxGram) and len(leaf.kept) == 1  # not alice's
    other = list(history)
    other[50] = (other[50] + 1) % 12
    assert leaf.proposer("alice", other + [1]) is not index  # diverges inside the history
    assert leaf.proposer("alice", history[:99]) is not index  # shorter than the history
    assert leaf.proposer("alice", history + [1]) is index


def test_the_store_keeps_the_most_recent_within_its_token_bound():
    kept = KeptIndexes(max_tokens=250)
    indexes = []
    for i in range(4):
        tokens = tuple(_tokens(100, seed=10 + i))
        indexes.append((tokens, MaxGram()))
        kept.put("", *indexes[-1])
    assert len(kept) == 2  # 200 tokens of the last two; the first two went, oldest first
    assert kept.take("", list(indexes[0][0]) + [1]) is None
    assert kept.take("", list(indexes[3][0]) + [1]) is indexes[3][1]


def test_suffix_decoding_resumes_its_own_trie_and_proposes_as_a_fresh_one():
    from cascade_service.config import SuffixConfig
    from cascade_service.core.proposers.suffix import SuffixDecoder
    from cascade_service.engine.leaves import SuffixLeaf

    leaf = SuffixLeaf(SuffixConfig())
    history = _tokens(300, seed=4)
    first = leaf.proposer("alice", history)
    first.propose(Context(history[:200], 200), 5)
    first.finish(history)
    context = history + _tokens(20, seed=5)
    resumed = leaf.proposer("alice", context)
    assert resumed is first and resumed.indexed == len(history)
    fresh = SuffixDecoder(leaf.caches.of("alice"), leaf.corpus)  # the same key's shared trie
    for end in range(len(context) - 10, len(context) + 1, 5):
        ctx = Context(context[:end], end - 2)
        assert resumed.propose(ctx, 6) == fresh.propose(ctx, 6)


def test_the_longest_continued_sequence_is_found_among_many_that_open_alike():
    # Every request asks the store (engine.leaves.KeptIndexes files sequences by their opening): under
    # one shared opening (a system prompt) it still returns the longest sequence the context starts
    # with, whatever its length, and none that the context only shares the opening with.
    kept = KeptIndexes()
    system = tuple(_tokens(40, seed=20))
    histories = [system + tuple(_tokens(30 + i, seed=30 + i)) for i in range(20)]
    for i, history in enumerate(histories):
        kept.put("", history, f"h{i}")
    kept.put("", system, "system")
    short = tuple(_tokens(3, seed=50))
    kept.put("", short, "short")  # shorter than an opening
    kept.put("", short + (7, 7, 7, 7, 7, 7, 7), "longer")
    assert kept.take("", list(histories[7]) + [1, 2]) == "h7"
    assert kept.take("", list(system) + [99]) == "system"  # only the opening in common with the others
    assert kept.take("", list(histories[7])) is None  # both taken: one request at a time
    assert kept.take("", list(short) + [7] * 7 + [1]) == "longer"
    assert kept.take("", list(short) + [7] * 6) == "short"
    assert kept.take("", list(short[:2])) is None
    assert kept.take("x", list(histories[3]) + [1]) is None  # another key's
    assert len(kept) == 19


def test_a_sequence_put_again_is_kept_once_with_its_new_index():
    kept = KeptIndexes(max_tokens=250)
    tokens = tuple(_tokens(100, seed=60))
    kept.put("", tokens, "old")
    kept.put("", tuple(_tokens(100, seed=61)), "other")
    kept.put("", tokens, "new")  # now the most recent: the next to go is "other"
    kept.put("", tuple(_tokens(100, seed=62)), "third")
    assert len(kept) == 2
    assert kept.take("", list(tokens) + [1]) == "new"
