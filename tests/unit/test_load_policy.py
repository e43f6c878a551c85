"""Load-adaptive speculation (core.load): the EWIF trade, measured terms, per-request acceptance."""

from __future__ import annotations

import pytest

from cascade_service.core.load import DraftBudget, LoadModel, PassTimer, expected_tokens


def _timer(fixed_s: float, per_token_s: float, batch: int) -> PassTimer:
    timer = PassTimer(min_passes=4)
    for tokens in (batch, 2 * batch, 4 * batch, 8 * batch):
        timer.record(batch, tokens, fixed_s + per_token_s * tokens)
    return timer


def test_the_pass_cost_is_fitted_from_recorded_passes():
    cost = _timer(0.010, 0.0005, 4).cost()
    assert cost.fixed_s == pytest.approx(0.010) and cost.per_token_s == pytest.approx(0.0005)
    assert PassTimer(min_passes=4).cost() is None  # nothing measured
    same = PassTimer(min_passes=2)
    same.record(1, 5, 0.01)
    same.record(1, 5, 0.02)
    assert same.cost() is None  # one size only: no slope to fit


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0


def test_speculate_fully_when_passes_cost_mostly_their_fixed_part():
    model = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0001, batch=1), draft_ratio=0.1)
    assert model.best_block(0.8, 6) == 6


def test_stop_speculating_when_the_batch_makes_passes_compute_bound():
    # 64 requests share the fixed part; each verified token costs as much as the shared part: drafts
    # that are rejected half the time no longer pay.
    model = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0005, batch=64), draft_ratio=0.1)
    assert model.best_block(0.5, 6) == 0
    assert 0 < model.best_block(0.95, 6) < 6  # very good drafts still pay, but fewer of them


def test_low_acceptance_drafts_less_even_when_idle():
    model = LoadModel(_timer(fixed_s=0.010, per_token_s=0.001, batch=1), draft_ratio=0.3)
    assert model.best_block(0.2, 8) < model.best_block(0.9, 8)


def test_without_measurements_the_schedule_is_used_as_configured():
    assert LoadModel(PassTimer(), draft_ratio=0.5).best_block(0.1, 5) == 5


def test_a_budget_learns_acceptance_from_reviews():
    budget = DraftBudget(LoadModel(_timer(0.02, 0.0005, 64), 0.1), max_block=6)
    assert budget.acceptance == 0.5
    for _ in range(20):
        budget.observe(drafted=6, accepted=6)  # no rejections at all
    assert budget.acceptance > 0.95
    high = budget()
    for _ in range(200):
        budget.observe(drafted=4, accepted=0)
    assert budget.acceptance < 0.2 and budget() == 0 < high
    assert budget.chosen == [high, 0]
