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
