"""Counters: acceptance by position, rejections, mean accepted length and SWI (paper §5)."""

import pytest

from cascade_service.core.stats import CascadeStats, ReviewCounters


def test_a_review_counts_a_rejection_only_when_a_draft_was_dropped():
    r = ReviewCounters()
    r.record(["base", "base", "mag"], 3)  # whole block kept
    r.record(["base", "mag"], 1)  # second draft rejected
    r.record([], 0)  # empty draft: nothing to reject
    assert (r.reviews, r.drafted, r.accepted, r.rejections) == (3, 5, 4, 1)
    assert r.accepted_by_position == [2, 1, 1] and r.drafted_by_position == [2, 2, 1]
    assert r.accepted_by_drafter == {"base": 3, "mag": 1}


def test_swi_weights_drafter_calls_by_cost_and_mag_costs_nothing():
    s = CascadeStats("large")
    s.tier("large").calls = 10
    s.tier("base").calls = 20
    s.tier("mag").calls = 50
    s.generated = 40
    assert s.swi({"base": 0.25}) == pytest.approx(40 / (10 + 20 * 0.25))
    assert s.mean_accepted_length == 4.0
