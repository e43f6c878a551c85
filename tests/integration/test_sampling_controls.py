"""top_k and min_p reach every tier and the final review: sampling at temperature 1 with top_k = 1 (or a
min_p that keeps only the most likely token) must give the target's greedy tokens, the oracle's, in
process and through the wire codec every remote tier uses; with a wider top_k the output differs from
greedy yet never leaves the target's top k at any position."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade_service.config import GenerationConfig
from cascade_service.core.cascade import Lookup
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import make_engine, oracle

PROMPTS = random_prompts(2, 10, seed=93)
N = 16
TOP_K = 3
NAMES, K_MATRIX = ["close", "mid", "mag"], [[4, 2, 0], [0, 2, 6], [0, 0, 6]]


@pytest.mark.parametrize("loopback", [False, True], ids=["in-process", "wire"])
def test_top_k_1_and_a_strict_min_p_sample_the_greedy_tokens(tiny_family, loopback):
    engine = make_engine(tiny_family, NAMES, K_MATRIX, 1.5, lookup=Lookup(2, 10), loopback=loopback)
    for i, prompt in enumerate(PROMPTS):
        expected = oracle(tiny_family["target"], prompt, N)
        for controls in (dict(top_k=1), dict(min_p=0.999)):
            gen = GenerationConfig(max_new_tokens=N, temperature=1.0, seed=11 + i, **controls)
            assert engine.generate(prompt, gen).token_ids == expected, controls
        # The control matters: without it, sampling at temperature 1 leaves the greedy path.
        free = engine.generate(prompt, GenerationConfig(max_new_tokens=N, temperature=1.0, seed=11 + i))
        assert free.token_ids != expected


def test_every_sampled_token_is_within_the_targets_top_k(tiny_family):
    engine = make_engine(tiny_family, NAMES, K_MATRIX, 1.5, lookup=Lookup(2, 10))
    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], local_files_only=True).eval()
    for seed in range(3):
        prompt = PROMPTS[0]
        out = engine.generate(
            prompt, GenerationConfig(max_new_tokens=N, temperature=1.5, top_k=TOP_K, seed=seed)
        ).token_ids
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
        top3 = logits.topk(3, dim=-1).indices
        assert all(t in top3[i] for i, t in enumerate(out)), (seed, out)


SHAPES = {
    "sd": (["close"], [[4]], None),
    "vertical": (["close", "mid"], [[3, 3], [0, 4]], None),
    "horizontal+mag": (NAMES, K_MATRIX, Lookup(2, 10)),
}


@pytest.mark.parametrize("loopback", [False, True], ids=["in-process", "wire"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_with_logit_bias_equals_transformers_sequence_bias(tiny_family, shape, loopback):
    names, k_matrix, lookup = SHAPES[shape]
    engine = make_engine(tiny_family, names, k_matrix, 1.5, lookup=lookup, loopback=loopback)
    for prompt in PROMPTS:
        plain = oracle(tiny_family["target"], prompt, N)
        # Ban the greedy path's first and fifth tokens and favour two others: the output must move.
        bias = {plain[0]: -100.0, plain[4]: -100.0, 7: 2.5, 11: 1.5}
        expected = oracle(tiny_family["target"], prompt, N, logit_bias=bias)
        assert expected != plain
        got = engine.generate(prompt, GenerationConfig(max_new_tokens=N, logit_bias=bias))
        assert got.token_ids == expected, (shape, loopback)


@pytest.mark.parametrize("loopback", [False, True], ids=["in-process", "wire"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_with_penalties_equals_transformers(tiny_family, shape, loopback):
    names, k_matrix, lookup = SHAPES[shape]
    engine = make_engine(tiny_family, names, k_matrix, 1.5, lookup=lookup, loopback=loopback)
    prompt = PROMPTS[0]
    plain = oracle(tiny_family["target"], prompt, N)
    cases = [
        (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (dict(presence_penalty=1.5, frequency_penalty=0.7), dict(penalties=(1.5, 0.7))),
        (dict(repetition_penalty=1.2, frequency_penalty=2.0), dict(repetition_penalty=1.2, penalties=(0.0, 2.0))),
    ]
    for ours, theirs in cases:
        expected = oracle(tiny_family["target"], prompt, N, **theirs)
        assert expected != plain, ours  # the penalty moves the output, so the check means something
        got = engine.generate(prompt, GenerationConfig(max_new_tokens=N, **ours))
        assert got.token_ids == expected, (shape, loopback, ours)
