"""Logprobs from the final review's own pass: each output token's log-probability under the target's
(processed) distribution and the N most likely alternatives, equal to `transformers`' `generate()`
output_scores within 1e-4, in every cascade shape, in process and through the wire codec, with a
logits processor in play too (repetition_penalty); trimmed to the output at EOS and at the budget."""

from __future__ import annotations

import pytest
import torch

from cascade_service.config import GenerationConfig
from cascade_service.core.cascade import Lookup
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import greedy_generate, make_engine

PROMPTS = random_prompts(2, 10, seed=97)
N, TOP = 20, 5
SHAPES = {
    "sd": (["close"], [[4]], None),
    "vertical": (["close", "mid"], [[3, 3], [0, 4]], None),
    "horizontal+mag": (["close", "mid", "mag"], [[4, 2, 0], [0, 2, 6], [0, 0, 6]], Lookup(2, 10)),
}


def _transformers(target, prompt, **controls):
    out = greedy_generate(target, prompt, N, output_scores=True, return_dict_in_generate=True, **controls)
    tokens = out.sequences[0, len(prompt) :].tolist()
    rows = torch.log_softmax(torch.cat(out.scores).float(), dim=-1)  # [N, V], the processed scores
    return tokens, rows


@pytest.mark.parametrize("loopback", [False, True], ids=["in-process", "wire"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_logprobs_equal_transformers_output_scores(tiny_family, shape, loopback):
    names, k_matrix, lookup = SHAPES[shape]
    engine = make_engine(tiny_family, names, k_matrix, 1.5, lookup=lookup, loopback=loopback)
    for prompt, controls in ((PROMPTS[0], {}), (PROMPTS[1], {"repetition_penalty": 1.4})):
        tokens, rows = _transformers(tiny_family["target"], prompt, **controls)
        got = engine.generate(prompt, GenerationConfig(max_new_tokens=N, logprobs=TOP, **controls))
        assert got.token_ids == tokens
        logprobs = got.stats.logprobs
        assert [t.token for t in logprobs] == tokens
        for i, t in enumerate(logprobs):
            assert abs(t.logprob - float(rows[i, t.token])) < 1e-4, (shape, i)
            best = rows[i].topk(TOP)
            assert [token for token, _ in t.top] == best.indices.tolist(), (shape, i)
            assert max(abs(lp - float(v)) for (_, lp), v in zip(t.top, best.values, strict=True)) < 1e-4


def test_no_logprobs_unless_asked_and_zero_alternatives_gives_the_token_alone(tiny_family):
    engine = make_engine(tiny_family, ["close"], [[4]], 1.5)
    assert engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=8)).stats.logprobs == []
    alone = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=8, logprobs=0)).stats.logprobs
    assert len(alone) == 8 and all(t.top == () and t.logprob <= 0.0 for t in alone)
    with pytest.raises(ValueError, match=r"^logprobs must be in \[0, 20\]"):
        GenerationConfig(logprobs=21)
