"""A seed fixes a lossless sampled output, whatever was drafted (issue 59, point 0).

A lossless sampled request draws by position: the noise at sequence position t is a function of (seed,
t) alone (core.placement `keyed_exponentials`), each tier's token there is its race winner under that
noise (core.sampling `race`), and a review keeps a draft that is its own winner (core.review
`KeyedReview`). The output is then the target's race path: the same tokens under plain decoding and
under every schedule, and distributed as the target's (the chi-square checks in
test_exact_distribution.py run on this path; the checks here add what they cannot see).
"""

from __future__ import annotations

from collections import Counter

import torch

from cascade_service.core import placement
from cascade_service.core.policy import OFF
from cascade_service.core.sampling import SamplingParams, race

from ..helpers.toy import chi_square_rejects
from ..helpers.toy_cascade import CASES, SAMPLES, sample_cascade

SAMPLINGS = [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(1.0, repetition_penalty=1.6)]


def _output(case: str | None, sampling: SamplingParams, seed: int, keyed: bool = True) -> tuple[int, ...]:
    """One request's 3-token output under `case`'s schedule (None: plain decoding, nothing drafted)."""
    names, k, leniency, *lookup = CASES[case or "sd_small"]
    counts, _ = sample_cascade(
        names,
        k,
        leniency,
        sampling,
        samples=1,
        seed=seed,
        lookup=lookup[0] if lookup else None,
        policy=(lambda: OFF) if case is None else None,
        keyed=keyed,
    )
    (out,) = counts
    return out


def test_the_same_seed_gives_the_same_tokens_under_plain_decoding_and_every_schedule():
    for sampling in SAMPLINGS:
        for seed in range(12):
            plain = _output(None, sampling, seed)
            for case in CASES:
                assert _output(case, sampling, seed) == plain, (case, sampling, seed)


def test_speculative_sampling_from_a_call_generator_does_not_fix_the_output():
    # The negative control: drawing per call (what lossy requests' inner reviews do) makes the tokens
    # depend on the draft path, so the check above can fail.
    sampling = SamplingParams(1.0)
    differs = [
        seed
        for seed in range(12)
        if any(
            _output(case, sampling, seed, keyed=False) != _output(None, sampling, seed, keyed=False) for case in CASES
        )
    ]
    assert differs


def test_a_race_winner_is_distributed_as_its_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    counts = Counter(race(probs, seed, 7)[0] for seed in range(SAMPLES))
    expected = {token: float(p) for token, p in enumerate(probs[0])}
    rejects, stat, crit = chi_square_rejects(
        {(t,): c for t, c in counts.items()}, {(t,): p for t, p in expected.items()}, SAMPLES
    )
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}"


def test_noise_shared_between_positions_is_caught_by_the_distribution_check(monkeypatch):
    # The noise must differ from position to position: with one draw for every position of a request
    # (the key ignoring the position) the output's joint distribution is wrong and the check sees it.
    key = placement.position_key
    monkeypatch.setattr(placement, "position_key", lambda seed, position: key(seed, 0))
    names, k, leniency = CASES["csd_base_small_mag_lenient"]
    counts, expected = sample_cascade(names, k, leniency, SamplingParams(1.0))
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert rejects, f"shared noise passed (chi-square {stat:.1f} <= {crit:.1f})"


def test_the_noise_of_a_position_depends_on_the_seed_and_the_position_alone():
    like = torch.zeros(4, 50)
    block = placement.keyed_exponentials(4, like, seed=11, start=20)
    assert torch.equal(placement.keyed_exponentials(2, like, seed=11, start=22), block[2:])  # another block's view
    assert not torch.equal(placement.keyed_exponentials(4, like, seed=12, start=20), block)
    assert (block > 0).all() and torch.isfinite(block).all()


def _oracle_noise(vocab: int, seed: int, position: int) -> torch.Tensor:
    """A position's noise drawn afresh: a generator seeded with the position's key, V draws, -log."""
    gen = torch.Generator().manual_seed(placement.position_key(seed, position))
    return -torch.empty(vocab).uniform_(generator=gen).log()


def test_a_noise_row_handed_out_again_is_the_row_its_position_draws_and_the_rows_kept_are_bounded(monkeypatch):
    # A drafter races position t, then its reviewer races t again: the row drawn first is kept and handed
    # out again (core.placement `_KeyedGenerators`). It must stay the position's own noise after every
    # use, and what a thread keeps must stay within its bound.
    from cascade_service.core import review
    from cascade_service.core.types import Draft

    monkeypatch.setattr(placement, "_KEYED", placement._KeyedGenerators())
    monkeypatch.setattr(placement, "NOISE_CACHE_BYTES", 0)
    monkeypatch.setattr(placement, "NOISE_CACHE_MIN_ROWS", 3)
    vocab, seed = 64, 29
    like = torch.zeros(1, vocab)
    first = placement.keyed_exponentials(1, like, seed, 40)
    probs = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)), dim=-1)
    review.KeyedReview(seed, 40).review(Draft(tokens=[int(first[0].argmin()), 0]), probs, 2.0, torch.Generator())
    again = placement.keyed_exponentials(3, like, seed, 40)  # rows 40 (kept) and 41, 42
    for i in range(3):
        assert torch.equal(again[i], _oracle_noise(vocab, seed, 40 + i)), i
    assert torch.equal(first[0], _oracle_noise(vocab, seed, 40))  # no use changed the kept row
    for position in range(100, 110):
        placement.keyed_exponentials(1, like, seed, position)
    assert len(placement._KEYED.rows) == 3  # the oldest dropped first
    assert torch.equal(placement.keyed_exponentials(1, like, seed, 40)[0], _oracle_noise(vocab, seed, 40))
    assert placement.keyed_exponentials(1, torch.zeros(1, vocab + 1), seed, 40).shape == (1, vocab + 1)  # its own row


def _winners(probs: torch.Tensor, seed: int, start: int, leniency: float, drafts: list[int]) -> tuple[int, int]:
    """The oracle: each row's race drawn on its own (a generator seeded with the position's key, V draws),
    the first draft that is neither its row's winner nor within `leniency` of it. (accepted, token)."""
    for i in range(len(probs)):
        gen = torch.Generator().manual_seed(placement.position_key(seed, start + i))
        scores = probs[i] / -torch.empty(probs.shape[1], dtype=probs.dtype).uniform_(generator=gen).log()
        winner = int(scores.argmax())
        if i == len(drafts) or (drafts[i] != winner and leniency * scores[drafts[i]] < scores[winner]):
            return i, winner
    raise AssertionError("unreachable: the last row has no draft")


def test_a_keyed_review_on_the_cpu_draws_the_rows_up_to_its_first_rejection_only(monkeypatch):
    # Each row's noise is a re-seed and V draws; where drafts disagree (a MaG copy at T = 1) most rows
    # of a block are never reached, so the CPU review races them one at a time and stops.
    from cascade_service.core import review
    from cascade_service.core.types import Draft

    drawn: list[int] = []
    keyed = review.keyed_exponentials
    monkeypatch.setattr(review, "keyed_exponentials", lambda rows, *a: drawn.append(rows) or keyed(rows, *a))
    gen = torch.Generator().manual_seed(3)
    checked = {True: 0, False: 0}
    for case in range(60):
        k, vocab, seed, start = 1 + case % 9, 300, 1000 + case, 5 * case
        probs = torch.softmax(3.0 * torch.randn(k + 1, vocab, generator=gen), dim=-1)
        leniency = 1.0 if case % 3 else 2.0
        # drafts that follow the rows' winners for a while (up to `keep`), then a random guess
        keep = case % (k + 1)
        drafts = []
        for i in range(k):
            token = (
                _winners(probs, seed, start, 1.0, drafts + [-1])[1]
                if i < keep
                else int(torch.randint(vocab, (1,), generator=gen))
            )
            drafts.append(token)
        accepted, token = _winners(probs, seed, start, leniency, drafts)
        drawn.clear()
        verdict = review.KeyedReview(seed, start).review(Draft(tokens=drafts), probs, leniency, gen)
        assert (verdict.accepted, verdict.token) == (accepted, token), case
        assert sum(drawn) == accepted + 1, (case, drawn)
        checked[accepted == k] += 1
    assert checked[True] and checked[False]  # blocks kept whole and blocks cut short both ran


def test_the_race_read_on_the_host_is_torchs_division_bit_for_bit():
    # On the CPU the race's scores are divided in numpy over the tensors' memory (placement.host_race);
    # a seed fixes the output only if they are the very floats torch's division gives.
    gen = torch.Generator().manual_seed(17)
    for rows, vocab in ((1, 2048), (3, 300), (5, 50)):
        probs = torch.softmax(4.0 * torch.randn(rows, vocab, generator=gen), dim=-1)
        noise = placement.keyed_exponentials(rows, probs, seed=rows, start=vocab)
        tokens = torch.randint(vocab, (rows,), generator=gen).tolist()
        scores = probs / noise
        best = scores.argmax(-1).tolist()
        got = placement.host_race(probs, noise, tokens)
        assert got[0] == best
        assert got[1] == [float(scores[i, t]) for i, t in enumerate(best)]
        assert got[2] == [float(scores[i, t]) for i, t in enumerate(tokens)]
