"""MaG (paper §3): longest suffix, earliest occurrence, virtual extension, bigram fill; bounded cost."""

import itertools
import json
import random
from collections import Counter

import pytest
import torch

from cascade_service.core.proposers import mag
from cascade_service.core.proposers import pairs as mag_pairs
from cascade_service.core.proposers.mag import BigramTable, MaxGram
from cascade_service.core.types import Context


def committed(tokens, tail=()):
    return Context(list(tokens) + list(tail), len(tokens))


def naive_propose(tokens, k, max_ngram, table):
    """O(n^2) reference: the rule written as plainly as possible."""
    seq, out = list(tokens), []
    while len(out) < k:
        end, follower = len(seq), None
        for n in range(min(max_ngram, end - 1), 0, -1):
            follower = next((i + n for i in range(end - n) if seq[i : i + n] == seq[end - n :]), None)
            if follower is not None:
                break
        if follower is None:
            break
        take = seq[follower : min(end, follower + k - len(out))]
        seq += take
        out += take
    while len(out) < k and seq and table is not None and table.get(seq[-1]) is not None:
        seq.append(table[seq[-1]])
        out.append(seq[-1])
    return out


# --- matching -------------------------------------------------------------------------------


def test_longest_suffix_match_wins_over_shorter_earlier_match():
    tokens = [7, 3, 5, 1, 2, 3, 4, 6, 1, 2, 3]  # [3] first seen before 5; [1, 2, 3] before 4
    assert MaxGram().propose(committed(tokens), 1) == [4]
    assert MaxGram(max_ngram=1).propose(committed(tokens), 1) == [5]


def test_earliest_occurrence_of_the_longest_match_is_used():
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert MaxGram().propose(committed(tokens), 3) == [7, 1, 2]


def test_prompt_match_preferred_over_generated_text():
    prompt, generated = [5, 6, 1, 2, 9], [1, 2, 4, 0, 1, 2]
    ctx = Context(prompt + generated, len(prompt) + 3)
    assert MaxGram().propose(ctx, 1) == [9]


def test_match_found_in_the_pending_tail():
    ctx = committed([1, 2, 3], tail=[8, 9, 8])  # [8] only occurs in the tail
    assert MaxGram().propose(ctx, 1) == [9]


def test_runs_past_end_of_match_by_matching_its_own_proposals():
    tokens = [4, 1, 2, 3, 1, 2]  # continuation of [1, 2] is [3, 1, 2], then the period repeats
    assert MaxGram().propose(committed(tokens), 8) == [3, 1, 2, 3, 1, 2, 3, 1]


def test_lookup_needs_a_match_at_least_min_match_long_and_never_fills_from_the_bigram():
    table = BigramTable(10, [1] * 10)  # would fill every position if lookup used it
    tokens = [4, 1, 2, 3, 9, 2]  # the suffix [2] matches (length 1), [9, 2] does not
    assert MaxGram(table).lookup(committed(tokens), 4, min_match=2) == []
    assert MaxGram(table).lookup(committed(tokens), 4, min_match=1) == [3, 9, 2, 3]
    assert MaxGram(table).lookup(committed([5, 6, 7, 8]), 4, min_match=1) == []
    assert MaxGram(table).propose(committed([5, 6, 7, 8]), 2) == [1, 1]


def test_lookup_continues_the_longest_match_like_propose():
    tokens = [4, 1, 2, 3, 1, 2]
    assert MaxGram().lookup(committed(tokens), 8, min_match=2) == MaxGram().propose(committed(tokens), 8)
    assert MaxGram().lookup(committed(tokens), 8, min_match=3) == []


def naive_lookup(tokens, k, max_ngram, min_match):
    """The lookup as plainly as possible: the longest earlier match, empty where it is under min_match."""
    seq = list(tokens)
    longest = next(
        (
            n
            for n in range(min(max_ngram, len(seq) - 1), 0, -1)
            if any(seq[i : i + n] == seq[-n:] for i in range(len(seq) - n))
        ),
        0,
    )
    return naive_propose(seq, k, max_ngram, None) if longest >= max(min_match, 1) else []


@pytest.mark.parametrize("seed", range(40))
def test_lookup_matches_brute_force_oracle_over_a_request(seed):
    # The pre-check (the last two tokens seen before?) answers most lookups without the full index;
    # either way the lookup must be the rule's.
    rng = random.Random(1000 + seed)
    vocab = rng.choice([3, 6, 20])
    max_ngram = rng.choice([1, 2, 3, 16])
    m = MaxGram(None, max_ngram)
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
    for _ in range(12):
        tail = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        k, min_match = rng.randrange(0, 12), rng.choice([1, 2, 3])
        got = m.lookup(committed(tokens, tail), k, min_match)
        assert got == naive_lookup(tokens + tail, k, max_ngram, min_match)
        tokens += [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]


def test_a_lookup_that_cannot_match_builds_no_index():
    prompt = list(range(2000))  # no pair recurs: no lookup of two tokens or more can match
    m = MaxGram(max_ngram=16)
    assert m.lookup(committed(prompt), 10, min_match=2) == []
    assert m.index_ops <= 4 * len(prompt) + 1  # four dict operations a token, not two per length (32)
    # A pair that recurs in the pending tail is found there; committed later, in the index.
    tail = [3000, 3001, 5, 3000, 3001]
    assert m.lookup(committed(prompt, tail), 7, min_match=2) == [5, 3000, 3001, 5, 3000, 3001, 5]
    assert m.lookup(committed(prompt + tail), 3, min_match=2) == [5, 3000, 3001]
    assert m.index_ops <= 4 * (len(prompt) + len(tail)) + 100


@pytest.mark.parametrize("run", [mag_pairs.PAIR_CANDIDATES, mag_pairs.PAIR_CANDIDATES + 1, 500])
def test_a_lookup_on_a_long_run_of_one_token_reads_the_trie_past_the_pair_bound(run):
    # A pair with more earlier occurrences than PAIR_CANDIDATES is not compared one by one: the trie
    # answers (16 dict operations a call, whatever the run); below the bound the pairs do. Both as the rule.
    tokens = [1, 2] + [5] * run + [3, 5, 5]
    m = MaxGram(max_ngram=4)
    assert m.lookup(committed(tokens), 6, min_match=2) == naive_lookup(tokens, 6, 4, 2)
    trie_built = m._indexed > 0  # the trie's own count (`indexed` is whichever index was read)
    assert trie_built is (run - 1 > mag_pairs.PAIR_CANDIDATES)  # the pair (5, 5) has run - 1 followers


def test_stable_shrinking_raises_in_a_lookup_too():
    m = MaxGram()
    assert m.lookup(committed([1, 2, 3, 4, 5]), 2, min_match=2) == []
    with pytest.raises(ValueError, match="stable shrank from 5 to 2"):
        m.lookup(Context([1, 2, 3, 4, 5], 2), 2, min_match=2)


def test_bigram_fills_when_no_suffix_matches_and_stops_at_a_missing_entry():
    table = BigramTable(10, [-1, -1, -1, 5, -1, 6, 1, -1, -1, -1])
    assert MaxGram(table).propose(committed([9, 8, 3]), 10) == [5, 6, 1]


def test_virtual_match_always_continues_so_bigram_fill_follows_only_no_match():
    # Once a match runs into the end, the last token has a follower in the virtual sequence.
    table = BigramTable(10, [9] * 10)
    assert MaxGram(table).propose(committed([1, 2, 1]), 4) == [2, 1, 2, 1]


def test_no_match_no_table_gives_empty_proposal():
    assert MaxGram().propose(committed([1, 2, 3]), 5) == []
    assert MaxGram().propose(committed([]), 5) == []
    assert MaxGram(BigramTable(4, [1, 2, 3, 0])).propose(committed([]), 5) == []


def test_zero_tokens_asked_gives_empty_proposal():
    assert MaxGram().propose(committed([1, 2, 1, 2]), 0) == []


def test_pending_tail_is_not_indexed_permanently():
    m = MaxGram()
    assert m.propose(committed([1, 2, 3], tail=[7, 4]), 2) == []
    assert m.propose(committed([1, 2, 3], tail=[6, 7]), 2) == []  # [7] -> 4 must not leak
    assert m.propose(committed([1, 2, 3], tail=[6, 7, 5, 7]), 1) == [5]


def test_committed_tokens_are_indexed_once_the_tail_is_accepted():
    m = MaxGram()
    m.propose(committed([1, 2, 3], tail=[7, 4]), 2)
    assert m.propose(Context([1, 2, 3, 7, 4, 0, 7], 6), 1) == [4]


def test_stable_shrinking_raises():
    m = MaxGram()
    m.propose(committed([1, 2, 3, 4]), 1)
    with pytest.raises(ValueError, match="stable shrank from 4 to 2"):
        m.propose(Context([1, 2, 3, 4], 2), 1)


def test_stable_beyond_the_tokens_raises():
    with pytest.raises(ValueError, match="outside"):
        MaxGram().propose(Context([1, 2], 3), 1)


def test_proposals_are_plain_ints():
    table = BigramTable.from_tokens(torch.tensor([1, 2, 3, 4]), 5)
    out = MaxGram(table).propose(committed([0, 1]), 3) + MaxGram().propose(committed([1, 2, 1]), 2)
    assert out == [2, 3, 4, 2, 1] and all(type(t) is int for t in out)


@pytest.mark.parametrize("seed", range(40))
def test_propose_matches_brute_force_oracle_over_a_request(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5])
    max_ngram = rng.choice([1, 2, 3, 16])
    table = None
    if rng.random() < 0.7:
        stream = [rng.randrange(vocab + 1) for _ in range(30)]
        table = BigramTable.from_tokens(stream, vocab + 1)
    ref = None if table is None else {t: table.next(t) for t in range(vocab + 1)}
    m = MaxGram(table, max_ngram)
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
    for _ in range(12):  # a request: commit some tokens, draft against a changing tail
        tail = [rng.randrange(vocab + 1) for _ in range(rng.randrange(0, 6))]
        k = rng.randrange(0, 12)
        got = m.propose(committed(tokens, tail), k)
        assert got == naive_propose(tokens + tail, k, max_ngram, ref)
        tokens += [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]


def test_call_cost_does_not_grow_with_sequence_length():
    def ops_of_one_call(n):
        rng = random.Random(0)
        tokens = [rng.randrange(50) for _ in range(n + 5)]
        tail = [rng.randrange(50) for _ in range(10)]
        m = MaxGram(max_ngram=16)
        m.propose(committed(tokens[:n], tail), 8)  # the first call indexes the whole prompt
        before = m.index_ops
        m.propose(committed(tokens, tail), 8)  # 5 newly committed tokens
        return m.index_ops - before

    # (5 new + 10 tail + 8 proposed) positions x 16 lengths x (lookup + insert), plus 8 matches x 16
    bound = (5 + 10 + 8) * 16 * 2 + 8 * 16
    short, long = ops_of_one_call(200), ops_of_one_call(20_000)
    assert short <= bound and long <= bound


# --- bigram table ---------------------------------------------------------------------------


def test_bigram_keeps_the_most_frequent_follower():
    table = BigramTable.from_tokens([1, 2, 1, 2, 1, 3, 3, 3], 5)
    assert [table.next(t) for t in range(5)] == [None, 2, 1, 3, None]


def test_bigram_ties_go_to_the_smallest_token_id():
    table = BigramTable.from_tokens([5, 7, 5, 6, 5], 8)
    assert table.next(5) == 6


def test_bigram_out_of_vocab_lookup_gives_none():
    table = BigramTable.from_tokens([1, 2], 3)
    assert table.next(-1) is None and table.next(3) is None


def test_bigram_from_tokens_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        BigramTable.from_tokens([1, 3], 3)


def test_bigram_counts_across_chunks_match_a_counter(monkeypatch):
    monkeypatch.setattr(mag, "_CHUNK", 7)  # pairs straddle chunk edges and merges happen often
    rng = random.Random(1)
    stream = [rng.randrange(6) for _ in range(500)]
    counts = Counter(itertools.pairwise(stream))
    table = BigramTable.from_tokens(iter(stream), 6)
    for prev in range(6):
        best = min(((-c, nxt) for (p, nxt), c in counts.items() if p == prev), default=None)
        assert table.next(prev) == (None if best is None else best[1])


def test_bigram_from_a_large_stream_with_a_large_vocab():
    stream = torch.randint(0, 32000, (2_000_000,))
    table = BigramTable.from_tokens(stream, 32000)
    first, second = int(stream[0]), int(stream[1])
    assert table.vocab_size == 32000 and table.next(first) is not None
    assert BigramTable.from_tokens(stream[:2].tolist(), 32000).next(first) == second


def test_bigram_save_load_round_trip(tmp_path):
    table = BigramTable.from_tokens([1, 2, 1, 2, 3], 5)
    table.save(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc == {"format": "cascade-service/bigram-v1", "vocab_size": 5, "next": [-1, 2, 1, -1, -1]}
    loaded = BigramTable.load(tmp_path / "t.json")
    assert loaded.vocab_size == 5 and [loaded.next(t) for t in range(5)] == [None, 2, 1, None, None]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"format": "other", "vocab_size": 2, "next": [-1, -1]}', "expected format"),
        ("[1, 2]", "expected format"),
        ("not json", "invalid JSON"),
        ('{"format": "cascade-service/bigram-v1", "vocab_size": 0, "next": []}', "vocab_size"),
        ('{"format": "cascade-service/bigram-v1", "vocab_size": 2, "next": [1]}', "list of 2"),
        ('{"format": "cascade-service/bigram-v1", "vocab_size": 2, "next": [1, 2]}', "entries"),
    ],
)
def test_bigram_load_rejects_anything_but_its_own_format(tmp_path, text, message):
    (tmp_path / "t.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        BigramTable.load(tmp_path / "t.json")
