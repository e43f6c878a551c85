"""Sampling exactness: the cascade's output is distributed exactly as the target's (invariant 2).

The cases run as a lossless served request does, its draws keyed by position (core.sampling `race`);
speculative sampling from a call's generator, which a lossy request's inner reviews run, is checked apart.

Toy models over 4 tokens; the target's distribution over 3-token continuations is enumerated and the
cascade's samples are tested against it (chi-square, alpha ~ 0.001, fixed seeds). The same check is
shown to reject a one-token bias and a cascade that reviews against the inner reviewer's distribution
instead of the inner system's true proposal (the leniency pitfall: docs/algorithm.md "Leniency").
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from cascade_service.core import review as review_module
from cascade_service.core.policy import FIXED
from cascade_service.core.sampling import SamplingParams
from cascade_service.engine.policies.floor import FloorModel, GoodputFloor

from ..helpers.toy import chi_square_rejects, exact_distribution
from ..helpers.toy_cascade import CASES, LENGTH, PROMPT, SAMPLES, sample_cascade, toy_tiers


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(1.0),
        SamplingParams(0.7, top_p=0.9),
        SamplingParams(1.0, top_k=2),
        SamplingParams(1.2, top_k=3, min_p=0.3),
        SamplingParams(1.0, logit_bias=((1, 1.5), (2, -2.0))),
        SamplingParams(1.0, repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.4),
    ],
    ids=["t1", "t0.7_p0.9", "t1_k2", "t1.2_k3_minp0.3", "t1_bias", "t1_penalties"],
)
def test_cascade_output_distribution_equals_target_distribution(case, sampling):
    names, k, leniency, *lookup = CASES[case]
    counts, expected = sample_cascade(names, k, leniency, sampling, lookup=lookup[0] if lookup else None)
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}: output is not the target's distribution"


@pytest.mark.parametrize("case", ["sd_small", "csd_base_small_mag_lenient"])
def test_speculative_sampling_from_a_call_generator_is_exact_too(case):
    # The draws of a lossy request's inner reviews (core.review.SamplingReview): per call, not by position.
    names, k, leniency, *_ = CASES[case]
    counts, expected = sample_cascade(names, k, leniency, SamplingParams(1.0), keyed=False)
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}: output is not the target's distribution"


@pytest.mark.parametrize("prediction", [[3, 3, 3], [1, 2, 0, 1], [0]], ids=["unlikely", "plausible", "short"])
def test_a_predicted_output_leaves_the_distribution_the_targets(prediction):
    # The prediction is a point-mass drafter at the target, ahead of the lookup gate and the K-matrix.
    names, k, leniency, lookup = CASES["csd_base_mag_lookup"]
    counts, expected = sample_cascade(names, k, leniency, SamplingParams(1.0), lookup=lookup, prediction=prediction)
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}: output is not the target's distribution"


@pytest.mark.parametrize(
    "case, wire",
    [("sd_small", False), ("csd_base_mag_lookup", False), ("csd_base_small_mag_lenient", False)]
    + [("csd_base_small_mag_lenient", True)],
)
@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.8, top_k=3)], ids=["t1", "t0.8_k3"])
def test_under_a_grammar_the_output_is_distributed_as_the_masked_target(case, wire, sampling):
    # A response format (core.grammar): its forced tokens open each block as point-mass drafts, model
    # drafters in this process draft from masked distributions, inner reviewers review masked, and a
    # refused draft never survives a review; the output follows the masked target exactly. Through the
    # wire codec the drafters draft unmasked and the masks cross as bits. (Reporting a masked draft's
    # unmasked distribution as its row is caught here: chi-square rejected two of these cases.)
    names, k, leniency, *lookup = CASES[case]
    lookup_gate = lookup[0] if lookup else None
    counts, expected = sample_cascade(names, k, leniency, sampling, lookup=lookup_gate, grammar=True, wire=wire)
    assert all(expected[seq] == 0.0 for seq in expected if seq[0] != 3)  # the grammar forces the first token
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}: output is not the masked target's"
    assert all(expected[seq] > 0 for seq in counts), "a sample the grammar refuses"


@pytest.mark.parametrize("case", ["sd_small", "csd_base_mag_lookup", "csd_base_small_mag_lenient"])
def test_the_distribution_is_exact_under_the_floor(case):
    # The floor (engine.policies.floor) turns a source on and off from what earlier rounds kept, its own
    # request's and every request's: each round's block then depends on earlier draws, never on its own
    # review's. A clock of its own makes a drafting round cost 1.8 plain steps, so the decision follows
    # the acceptance the draws gave (on, off and probing all happen here).
    model = FloorModel()
    floors: list[GoodputFloor] = []

    def policy() -> GoodputFloor:
        clock = {"t": 0.0}

        def tick() -> float:
            clock["t"] += 1.0 + 0.8 * bool(floors[-1]._allowed)
            return clock["t"]

        floors.append(GoodputFloor(model, False, FIXED, clock=tick))
        return floors[-1]

    names, k, leniency, *lookup = CASES[case]
    lookup_gate = lookup[0] if lookup else None
    counts, expected = sample_cascade(names, k, leniency, SamplingParams(1.0), lookup=lookup_gate, policy=policy)
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}: output is not the target's distribution"
    drafted = sum(f.drafting_rounds for f in floors)
    assert 0 < drafted < sum(f.rounds for f in floors)  # it drafted in some rounds and not in others


@pytest.mark.parametrize("case", ["csd_base_mag_lookup", "csd_base_small_mag_lenient"])
def test_the_distribution_is_exact_through_the_wire_codec(case):
    # Drafts' rows, seeds and verdicts cross as bytes (transport.codec) and the output is still the target's.
    names, k, leniency, *lookup = CASES[case]
    counts, expected = sample_cascade(
        names, k, leniency, SamplingParams(1.0), lookup=lookup[0] if lookup else None, wire=True
    )
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}: output is not the target's distribution"


def test_the_wire_codec_changes_no_sampled_token():
    # Each tier call carries its seed, so the same request gives the same tokens in process and through the codec.
    names, k, leniency, lookup = CASES["csd_base_mag_lookup"]
    for seed in range(3):
        here, _ = sample_cascade(names, k, leniency, SamplingParams(1.0), samples=20, seed=seed, lookup=lookup)
        wired, _ = sample_cascade(
            names, k, leniency, SamplingParams(1.0), samples=20, seed=seed, lookup=lookup, wire=True
        )
        assert here == wired


# Invariant 6: each tier computes in its own dtype (logits in it), every review in float32.
DTYPES = {
    "target_bf16_drafters_f32": (torch.bfloat16, torch.float32),
    "target_f32_drafters_bf16": (torch.float32, torch.bfloat16),
}


@pytest.mark.parametrize("dtypes", sorted(DTYPES))
@pytest.mark.parametrize("case", ["sd_small", "csd_base_small_mag_lenient"])
def test_output_distribution_equals_the_target_distribution_with_mixed_dtypes(case, dtypes):
    # The oracle enumerates the target in its own dtype: a bfloat16 target's distribution is the
    # softmax of its bfloat16 logits, and that is what the cascade must sample from.
    names, k, leniency = CASES[case]
    counts, expected = sample_cascade(names, k, leniency, SamplingParams(1.0), dtypes=DTYPES[dtypes])
    assert toy_tiers(*DTYPES[dtypes])[0].row(PROMPT).dtype == DTYPES[dtypes][0]
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}: output is not the target's distribution"


@pytest.mark.parametrize("dtypes", sorted(DTYPES))
def test_greedy_output_is_the_targets_argmax_path_with_mixed_dtypes(dtypes):
    target = toy_tiers(*DTYPES[dtypes])[0]
    greedy = list(PROMPT)
    for _ in range(LENGTH):
        greedy.append(int(target.row(greedy).argmax()))
    names, k, leniency = CASES["csd_base_small_mag_lenient"]
    counts, _ = sample_cascade(names, k, leniency, SamplingParams(0.0), samples=5, dtypes=DTYPES[dtypes])
    assert counts == Counter({tuple(greedy[len(PROMPT) :]): 5})


def test_distribution_check_detects_a_one_token_bias():
    # Power of the check: samples from the target distribution with 0.03 of mass moved onto one token
    # at the first position must be rejected at the same sample size.
    sampling = SamplingParams(1.0)
    target, _, _ = toy_tiers()
    expected = exact_distribution(target, PROMPT, LENGTH, sampling)
    # biased = 0.97 * target + 0.03 * (target conditioned on the first token being 1)
    first_one = sum(p for seq, p in expected.items() if seq[0] == 1)
    biased = {seq: 0.97 * p + (0.03 * p / first_one if seq[0] == 1 else 0.0) for seq, p in expected.items()}
    total = sum(biased.values())
    keys = list(biased)
    probs = torch.tensor([biased[k] / total for k in keys])
    draws = torch.multinomial(probs, SAMPLES, replacement=True, generator=torch.Generator().manual_seed(5))
    counts = Counter(keys[i] for i in draws.tolist())
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert rejects, f"a 0.03 one-token bias went undetected (chi-square {stat:.1f} <= {crit:.1f})"


def test_reviewing_against_inner_reviewer_probs_is_detected(monkeypatch):
    # The pitfall the design warns about: with leniency > 1, passing the inner reviewer's own
    # distribution upward (instead of the reviewed mixture) biases the output. The check must see it.
    # Speculative sampling (keyed=False) is where the rows matter: a lossy request's inner reviews run it;
    # a lossless request's keyed review does not read them (test_keyed_draws.py).
    monkeypatch.setattr(review_module, "reviewed_proposal", lambda target_probs, draft_probs, leniency: target_probs)
    names, k, _ = CASES["csd_base_small_mag_lenient"]
    counts, expected = sample_cascade(names, k, 3.0, SamplingParams(1.0), keyed=False)
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert rejects, f"the biased cascade passed (chi-square {stat:.1f} <= {crit:.1f})"


@pytest.mark.parametrize("temperature", [5.3e-39, 1e-30, 1e-6])
def test_a_vanishing_temperature_samples_the_greedy_continuation(temperature):
    # Found by the API fuzzer: logits / 5e-39 overflowed to inf and softmax returned NaN, which
    # crashed multinomial. The limit T -> 0 is greedy, so every sample must be the argmax path.
    sampling = SamplingParams(temperature)
    probs = sampling.probs(torch.tensor([[1.0, 3.0, 2.0, 3.0], [-4.0, 0.0, 9.0, 1.0]]))
    assert torch.isfinite(probs).all()
    assert probs.tolist() == [[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]]
    counts, _ = sample_cascade(["base", "mag"], [[2, 2], [0, 3]], 1.0, sampling, samples=20)
    target = toy_tiers()[0]
    greedy = list(PROMPT)
    for _ in range(LENGTH):
        greedy.append(int(target.row(greedy).argmax()))
    assert counts == Counter({tuple(greedy[len(PROMPT) :]): 20})
