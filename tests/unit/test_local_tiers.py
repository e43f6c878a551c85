"""Issue 48, point 9: `local_tiers` makes a statistical tier of any drafter that proposes (MaG, suffix
decoding, a predicted output), not of one class picked by `isinstance(t, MaxGram)`."""

from __future__ import annotations

import pytest

from cascade_service.core.local import ModelTier, Proposer, StatisticalTier, local_tiers
from cascade_service.core.proposers.mag import MaxGram
from cascade_service.core.proposers.prediction import PredictionProposer
from cascade_service.core.proposers.suffix import SuffixCache, SuffixDecoder, SuffixSettings

from ..helpers.toy import ToyScorer

VOCAB = 8


@pytest.mark.parametrize(
    "proposer",
    [
        MaxGram(),
        SuffixDecoder(SuffixCache(SuffixSettings(depth=4, cache_tokens=64))),
        PredictionProposer([1, 2, 3]),
    ],
    ids=["mag", "suffix", "prediction"],
)
def test_every_statistical_drafter_is_a_statistical_tier(proposer):
    target = ToyScorer("target", VOCAB, seed=0)
    _, (tier,) = local_tiers(VOCAB, target, [proposer])
    assert isinstance(proposer, Proposer)
    assert isinstance(tier, StatisticalTier) and tier.proposer is proposer


def test_a_scorer_is_a_model_tier():
    # The control: a model's scorer does not propose.
    target, drafter = ToyScorer("target", VOCAB, seed=0), ToyScorer("small", VOCAB, seed=1)
    top, (tier,) = local_tiers(VOCAB, target, [drafter])
    assert not isinstance(drafter, Proposer)
    assert isinstance(top, ModelTier) and isinstance(tier, ModelTier)
