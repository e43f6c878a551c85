"""Sampling controls (core.sampling.SamplingParams: temperature, top_k, top_p, min_p) against an
independent oracle: `transformers`' own logits warpers, chained in the order `generate()` chains them,
then softmax. The cascade's exactness under them (the output distributed as the processed target's) is
tests/unit/test_exact_distribution.py's, which uses these probabilities."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cascade_service.core.request import GenerationConfig
from cascade_service.core.sampling import SamplingParams

CONTROLS = [
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, top_k=50),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.9, top_k=20, top_p=0.8),
    dict(temperature=1.0, top_k=40, top_p=0.9, min_p=0.1),
    dict(temperature=2.0, top_k=1),
]


def _transformers(logits: torch.Tensor, temperature: float, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    return torch.softmax(warpers(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone()), dim=-1)


@pytest.mark.parametrize("controls", CONTROLS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_processed_distributions_equal_transformers_warpers(controls):
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(7)) * 3
    ours = SamplingParams(**controls).probs(logits)
    theirs = _transformers(logits, **controls)
    assert torch.allclose(ours, theirs, atol=1e-6), (ours - theirs).abs().max()
    assert ((ours > 0) == (theirs > 0)).all()  # the same tokens kept, not only close masses


def test_ties_at_the_kth_token_are_kept_as_transformers_keeps_them():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    ours = SamplingParams(1.0, top_k=2).probs(logits)
    assert torch.allclose(ours, _transformers(logits, 1.0, top_k=2), atol=1e-7)
    assert (ours[0, :4] > 0).all() and (ours[0, 4:] == 0).all()


def test_greedy_ignores_the_controls_and_neutral_values_change_nothing():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(SamplingParams(0.0, top_k=3, min_p=0.5).probs(logits), SamplingParams(0.0).probs(logits))
    assert torch.equal(SamplingParams(0.8, top_k=0, min_p=0.0).probs(logits), SamplingParams(0.8).probs(logits))
    assert torch.equal(SamplingParams(0.8, top_k=50).probs(logits), SamplingParams(0.8).probs(logits))  # k >= V


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", -1),
        ("top_k", 1.5),
        ("top_k", True),
        ("top_k", 1 << 21),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("min_p", "0.1"),
    ],
)
def test_out_of_range_controls_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be in"):
        GenerationConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"^{field} must be in"):
        SamplingParams(1.0, **{field: value})


def test_logit_bias_equals_transformers_sequence_bias_before_the_warpers():
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(9)) * 2
    bias = {3: 2.5, 17: -100.0, 299: 4.0, 0: -1.25}
    hf = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()])
    biased = hf(torch.zeros(6, 1, dtype=torch.long), logits.clone())
    for controls in (dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=30, min_p=0.05)):
        ours = SamplingParams(**controls, logit_bias=bias).probs(logits)
        if controls["temperature"] == 0.0:  # greedy: softmax at temperature 1, argmax moved by the bias
            theirs = torch.softmax(biased, dim=-1)
            assert (ours.argmax(-1) == biased.argmax(-1)).all()
        else:
            theirs = _transformers(biased, **controls)
        assert torch.allclose(ours, theirs, atol=1e-6), controls
    assert (SamplingParams(1.0, logit_bias=bias).probs(logits)[:, 17] < 1e-30).all()  # -100 bans a token


@pytest.mark.parametrize(
    "value, message",
    [
        ({i: 1.0 for i in range(1025)}, "at most 1024 tokens"),
        ({-1: 1.0}, "non-negative integers"),
        ({"3": 1.0}, "non-negative integers"),
        ({3: 101.0}, r"\[-100, 100\]"),
        ({3: float("nan")}, r"\[-100, 100\]"),
        ("3:1", "must map token ids"),
    ],
)
def test_a_bad_logit_bias_is_refused_naming_the_field(value, message):
    with pytest.raises(ValueError, match=rf"^logit_bias.*{message}"):
        GenerationConfig(logit_bias=value)
    assert GenerationConfig(logit_bias={5: 1, 2: -3.5}).logit_bias == ((2, -3.5), (5, 1.0))  # sorted, floats


def test_penalties_per_row_equal_transformers_and_openais_definition():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from ..helpers.oracle import OpenAIPenalties

    vocab, prompt = 40, [3, 5, 5, 9]
    tokens = prompt + [5, 7, 7, 3, 12]  # a scored sequence: context, then a block of 4 after 1 output token
    n = 5  # rows: after tokens[:5], ..., after tokens[:9]
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(5)) * 3
    params = SamplingParams(0.0, repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.9)
    ours = SamplingParams(
        1.0, repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.9, output_start=len(prompt)
    ).probs(logits, tokens)
    for i in range(n):
        seen = torch.tensor([tokens[: len(tokens) - n + 1 + i]])
        row = RepetitionPenaltyLogitsProcessor(1.7)(seen, logits[i : i + 1].clone())
        row = OpenAIPenalties(len(prompt), 0.6, 0.9)(seen, row)
        assert torch.allclose(ours[i], torch.softmax(row[0], dim=-1), atol=1e-6), i
    with pytest.raises(ValueError, match="penalties need the sequence"):
        params.probs(logits)


@pytest.mark.parametrize(
    "field, value",
    [("repetition_penalty", 0.0), ("repetition_penalty", 11.0), ("presence_penalty", 2.5), ("frequency_penalty", -3)],
)
def test_out_of_range_penalties_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be in"):
        GenerationConfig(**{field: value})


def test_temperature_one_gives_the_shifted_logits_probabilities_bit_for_bit():
    # At T = 1 probs skips the shift and the division (softmax shifts by the maximum itself); a seed
    # fixes a sampled output only if the probabilities are the same floats as the shifted form's.
    from cascade_service.core.sampling import sharpen

    gen = torch.Generator().manual_seed(5)
    for vocab, scale in ((300, 3.0), (2048, 40.0), (151_936, 12.0)):
        logits = torch.randn(4, vocab, generator=gen) * scale + 1e4 * (scale > 20)
        assert torch.equal(SamplingParams(1.0).probs(logits), torch.softmax(sharpen(logits, 1.0), dim=-1))
        for controls in (dict(top_k=20), dict(top_p=0.9), dict(min_p=0.05)):
            ours = SamplingParams(1.0, **controls).probs(logits)
            shifted = SamplingParams(1.0 + 1e-9, **controls)  # not 1: takes sharpen's division
            assert shifted.temperature != 1.0
            assert torch.equal(ours > 0, shifted.probs(logits) > 0)


@pytest.mark.parametrize("spread", ["peaked", "peaked and flat"])
def test_top_p_over_a_large_vocabulary_equals_transformers_and_sorts_only_where_it_must(spread, monkeypatch):
    # On the CPU top-p looks among each row's most likely tokens first (TOP_P_CANDIDATES): where they hold
    # top_p no row is sorted whole; a flat row (its nucleus past them) sends the call to the full sort.
    gen = torch.Generator().manual_seed(11)
    vocab = 20_000
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows = [(-a * ranks.log())[torch.randperm(vocab, generator=gen)] for a in (1.5, 2.0, 3.0)]
    if spread == "peaked and flat":
        rows.append(torch.randn(vocab, generator=gen) * 0.3)  # the nucleus holds most of the vocabulary
    logits = torch.stack(rows)
    sorts: list[int] = []
    sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: sorts.append(self.shape[-1]) or sort(self, *a, **k))
    for top_p in (0.5, 0.9, 0.95):
        sorts.clear()
        ours = SamplingParams(1.0, top_p=top_p).probs(logits)
        whole = vocab in sorts  # ours only: the oracle's sorts come after
        theirs = _transformers(logits, 1.0, top_p=top_p)
        assert torch.allclose(ours, theirs, atol=1e-6), (ours - theirs).abs().max()
        assert ((ours > 0) == (theirs > 0)).all()
        assert whole == (spread != "peaked"), (top_p, sorts)
