"""A greedy review decides on logits, as transformers' greedy search does, and computes no probabilities
that no one reads (`ReviewRequest.probs_unread`, `GreedyReview.decide`): the target's none, a lenient
inner review those of the rows where a draft is not the argmax, and its verdict's only when read."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cascade_service.core.local import ModelTier
from cascade_service.core.review import GreedyReview
from cascade_service.core.sampling import SamplingParams
from cascade_service.core.tier import GREEDY, ReviewRequest
from cascade_service.core.types import Context, Draft

from ..helpers.toy import ToyScorer
from ..helpers.toy_cascade import CASES, sample_cascade

VOCAB = 16


def test_a_greedy_target_review_takes_the_argmax_of_the_logits_not_of_the_probabilities():
    # Logits 0 and 1e-9 have one float32 probability (exp rounds the gap away): the argmax of the
    # probabilities is the first of them, transformers' greedy search (torch.argmax of the scores)
    # takes the second, and so must the target's review.
    logits = torch.full((2, 8), -5.0)
    logits[:, 2], logits[:, 5] = 0.0, 1e-9
    probs = torch.softmax(logits, dim=-1)
    assert probs[0, 2] == probs[0, 5]
    block = Draft([5], [1.0], None, ["d"])
    verdict = GreedyReview().decide(block, logits)
    assert (verdict.accepted, verdict.token) == (1, int(torch.argmax(logits[1]))) == (1, 5)
    assert len(verdict.token_probs) == 2 and all(math.isnan(p) for p in verdict.token_probs)
    assert GreedyReview().review(block, probs, 1.0, torch.Generator()).accepted == 0  # what probabilities decide


def _counting_softmax(monkeypatch) -> list[int]:
    calls = [0]
    softmax = torch.softmax

    def counted(*args, **kwargs):
        calls[0] += 1
        return softmax(*args, **kwargs)

    monkeypatch.setattr(torch, "softmax", counted)
    return calls


def _review(tier: ModelTier, ids: list[int], block: list[int], **options):
    sampling = options.get("sampling", GREEDY)
    draft = (
        Draft.point(block, VOCAB, sampling.carries_rows, "d")
        if sampling.carries_rows
        else Draft(block, [0.5] * len(block))
    )
    return tier.review(ReviewRequest("r", Context(ids + block, len(ids)), draft, **options))


def test_the_targets_review_decides_as_before_with_no_softmax(monkeypatch):
    calls = _counting_softmax(monkeypatch)
    rng = random.Random(3)
    for trial in range(200):
        tier = ModelTier(ToyScorer("target", VOCAB, seed=trial), VOCAB)
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        # a block that is the target's own greedy continuation for a while, then anything
        block: list[int] = []
        for _ in range(rng.randint(0, 5)):
            row = tier.scorer.row(ids + block)  # type: ignore[attr-defined]  # ToyScorer's
            block.append(int(row.argmax()) if rng.random() < 0.7 else rng.randrange(VOCAB))
        before = calls[0]
        unread = _review(tier, ids, block, probs_unread=True).verdict
        assert calls[0] == before, "the target's greedy review ran a softmax"
        read = _review(tier, ids, block).verdict
        assert calls[0] == before + 1
        assert (unread.accepted, unread.token) == (read.accepted, read.token), trial
        assert all(math.isnan(p) for p in unread.token_probs) and len(unread.token_probs) == unread.accepted + 1
        assert not any(math.isnan(p) for p in read.token_probs)


def test_probabilities_someone_reads_are_still_computed(monkeypatch):
    # Logprobs and sampling need every row's; a lenient review's verdict, read by a reviewer above, its own.
    calls = _counting_softmax(monkeypatch)
    tier = ModelTier(ToyScorer("target", VOCAB, seed=1), VOCAB)
    for options in (
        {"leniency": 2.0, "probs_unread": False},
        {"logprobs": 2, "probs_unread": True},
        {"sampling": SamplingParams(temperature=1.0), "probs_unread": True},
    ):
        before = calls[0]
        verdict = _review(tier, [1, 2, 3], [4, 5], **options).verdict
        assert calls[0] > before, options
        assert not any(math.isnan(p) for p in verdict.token_probs), options


def _greedy_block(rng: random.Random, scores: torch.Tensor, agree: float) -> Draft:
    """A block whose drafts are the rows' argmax with probability `agree`, else random; random proposal
    probabilities (a lenient review compares them)."""
    tokens = [int(row.argmax()) if rng.random() < agree else rng.randrange(VOCAB) for row in scores[:-1]]
    return Draft(tokens, [rng.random() for _ in tokens], None, ["d"] * len(tokens))


def test_a_lenient_review_on_logits_decides_as_the_review_of_every_rows_probabilities():
    rng = random.Random(7)
    for trial in range(400):
        scores = torch.randn(rng.randint(1, 7), VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
        block = _greedy_block(rng, scores, agree=0.6)
        leniency = rng.choice([1.0, 1.5, 2.0, 4.0])
        full = GreedyReview().review(block, torch.softmax(scores, dim=-1), leniency, torch.Generator())
        read = GreedyReview().decide(block, scores, leniency, probs_unread=False)
        unread = GreedyReview().decide(block, scores, leniency, probs_unread=True)
        assert (read.accepted, read.token) == (unread.accepted, unread.token) == (full.accepted, full.token), trial
        assert read.token_probs == pytest.approx(full.token_probs, rel=1e-6, abs=1e-9), trial
        assert len(unread.token_probs) == unread.accepted + 1 and all(math.isnan(p) for p in unread.token_probs)


def test_an_unread_lenient_review_computes_only_the_rows_where_a_draft_is_not_the_argmax(monkeypatch):
    rows: list[int] = []
    softmax = torch.softmax

    def counted(x, *args, **kwargs):
        rows.append(len(x))
        return softmax(x, *args, **kwargs)

    monkeypatch.setattr(torch, "softmax", counted)
    scores = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    best = scores.argmax(dim=-1).tolist()
    wrong = (best[2] + 1) % VOCAB
    # drafts 0, 1 the argmax, draft 2 not but kept leniently (proposal probability 0: any p passes), 3, 4 the argmax
    block = Draft([best[0], best[1], wrong, best[3], best[4]], [0.9, 0.9, 0.0, 0.9, 0.9], None, ["d"] * 5)
    verdict = GreedyReview().decide(block, scores, 2.0, probs_unread=True)
    assert (verdict.accepted, verdict.token, rows) == (5, best[5], [1])  # row 2's softmax alone
    rows.clear()
    verdict = GreedyReview().decide(block, scores, 2.0, probs_unread=False)
    assert (verdict.accepted, rows) == (5, [6])  # read above: every row's, once


def test_the_cascade_marks_unread_the_reviews_no_reviewer_above_reads():
    seen: dict[str, set[bool]] = {}

    class Recorder:
        def __init__(self, tier, request_id):
            self.tier = tier

        def __getattr__(self, name):
            return getattr(self.tier, name)

        def review(self, request):
            seen.setdefault(self.tier.name, set()).add(request.probs_unread)
            return self.tier.review(request)

    # The target's verdict goes nowhere; base's to the strict target alone; small's also to base's lenient
    # review, which reads a draft's probability where base's argmax differs.
    names, k_matrix, leniency = CASES["csd_base_small_mag_lenient"]
    sample_cascade(names, k_matrix, leniency, GREEDY, samples=3, wrap=Recorder)
    assert seen == {"target": {True}, "base": {True}, "small": {False}}
    seen.clear()  # sampled: the target's speculative sampling reads base's rows
    sample_cascade(names, k_matrix, leniency, SamplingParams(temperature=1.0), samples=3, wrap=Recorder)
    assert seen["base"] == seen["small"] == {False}
