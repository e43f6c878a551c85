"""Predicted outputs (core.proposers.prediction): the client's expected output drafts at the target. The output is
the oracle's whatever the prediction (exact, edited, unrelated, longer or shorter than the output), in
every cascade shape and through the wire codec; a right prediction makes far fewer target passes, a
wrong one costs few; the stats count the prediction's accepted and rejected tokens."""

from __future__ import annotations

import random

import pytest

from cascade_service.config import GenerationConfig
from cascade_service.core.cascade import Lookup
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import make_engine, oracle

PROMPTS = random_prompts(2, 10, seed=95)
N = 48
SHAPES = {
    "target-only": (["mag"], [[4]], None),
    "vertical": (["close", "mid"], [[3, 3], [0, 4]], None),
    "horizontal+mag": (["close", "mid", "mag"], [[4, 2, 0], [0, 2, 6], [0, 0, 6]], Lookup(2, 10)),
}


def _edited(tokens: list[int], every: int, seed: int) -> list[int]:
    """`tokens` with one token replaced and one inserted every `every` tokens (an edited file)."""
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(tokens):
        if i and i % every == 0:
            out += [rng.randrange(1, 200), rng.randrange(1, 200)]
            continue
        out.append(t)
    return out


def _prediction_counts(result) -> tuple[int, int]:
    return result.stats.reviews["target"].kept("prediction")


@pytest.mark.parametrize("loopback", [False, True], ids=["in-process", "wire"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_output_is_the_oracles_whatever_the_prediction(tiny_family, shape, loopback):
    names, k_matrix, lookup = SHAPES[shape]
    engine = make_engine(tiny_family, names, k_matrix, 1.5, lookup=lookup, loopback=loopback)
    for i, prompt in enumerate(PROMPTS):
        expected = oracle(tiny_family["target"], prompt, N)
        predictions = {
            "exact": expected,
            "edited": _edited(expected, 12, seed=i),
            "unrelated": random_prompts(1, N, seed=500 + i)[0],
            "longer": expected + expected[:10],
            "shorter": expected[: N // 2],
            "shifted": expected[5:],
        }
        plain = engine.generate(prompt, GenerationConfig(max_new_tokens=N))
        for name, prediction in predictions.items():
            got = engine.generate(prompt, GenerationConfig(max_new_tokens=N, prediction=tuple(prediction)))
            assert got.token_ids == expected, (shape, name)
            accepted, rejected = _prediction_counts(got)
            if name == "exact":
                assert accepted == N - got.stats.target_calls and rejected <= 1  # the last block may overshoot
                assert got.stats.target_calls <= N // 8 < plain.stats.target_calls
            if name == "edited":
                assert accepted > N // 2 and got.stats.target_calls < plain.stats.target_calls


def test_sampled_output_with_a_prediction_is_drawn_as_without_one_at_top_k_1(tiny_family):
    # At temperature 1 with top_k 1 the target's distribution is a point mass: the prediction, a point-mass
    # drafter, is kept exactly where the target agrees, and the output is the greedy one.
    engine = make_engine(tiny_family, ["close", "mag"], [[3, 3], [0, 4]], 1.5, lookup=Lookup(2, 10))
    prompt = PROMPTS[0]
    expected = oracle(tiny_family["target"], prompt, N)
    edited = tuple(_edited(expected, 10, seed=3))
    gen = GenerationConfig(max_new_tokens=N, temperature=1.0, top_k=1, seed=2, prediction=edited)
    assert engine.generate(prompt, gen).token_ids == expected


def test_speculation_off_ignores_the_prediction(tiny_family):
    engine = make_engine(tiny_family, ["close", "mag"], [[3, 3], [0, 4]], 1.5, lookup=Lookup(2, 10))
    prompt = PROMPTS[1]
    expected = oracle(tiny_family["target"], prompt, N)
    got = engine.generate(prompt, GenerationConfig(max_new_tokens=N, prediction=tuple(expected), speculation="off"))
    assert got.token_ids == expected and got.stats.target_calls == N and _prediction_counts(got) == (0, 0)


def test_a_bad_prediction_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="^prediction holds at most 32768 tokens"):
        GenerationConfig(prediction=tuple(range(40000)))
    with pytest.raises(ValueError, match="^prediction: token ids must be non-negative"):
        GenerationConfig(prediction=(1, -2))
    with pytest.raises(ValueError, match="^prediction must be token ids"):
        GenerationConfig(prediction="text")  # type: ignore[arg-type]
