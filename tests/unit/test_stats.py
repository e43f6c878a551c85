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


def test_per_tier_counts_calls_drafted_and_accepted_over_every_reviewer():
    s = CascadeStats("large")
    s.tier("large").calls = 3
    s.tier("base").calls = 5
    s.tier("mag").calls = 4
    s.tier("mag_lookup").calls = 2
    s.reviewer("large").record(["base", "base", "mag_lookup"], 2)  # the target kept 2 of base's
    s.reviewer("large").record(["mag_lookup", "mag_lookup"], 1)
    s.reviewer("base").record(["mag", "mag", "mag"], 1)  # base, reviewing MaG, kept one
    tiers = s.to_dict()["tiers"]
    assert tiers["large"] == {"calls": 3, "drafted": 0, "accepted": 0}
    assert tiers["base"] == {"calls": 5, "drafted": 2, "accepted": 2}
    assert tiers["mag"] == {"calls": 4, "drafted": 3, "accepted": 1}
    assert tiers["mag_lookup"] == {"calls": 2, "drafted": 3, "accepted": 1}
