"""Load-adaptive speculation (core.load): the EWIF trade, measured terms, per-request acceptance."""

from __future__ import annotations

import pytest

from cascade_service.core.load import DraftBudget, LoadModel, PassTimer, expected_tokens


def _timer(fixed_s: float, per_token_s: float, batch: int, per_request_s: float = 0.0) -> PassTimer:
    timer = PassTimer(min_passes=4)
    for rows, tokens in ((batch, batch), (batch, 2 * batch), (batch - 1 or 1, 4 * batch), (batch, 8 * batch)):
        timer.record(rows, tokens, fixed_s + per_request_s * rows + per_token_s * tokens)
    return timer


def test_the_pass_cost_is_fitted_from_recorded_passes():
    cost = _timer(0.010, 0.0005, 4, per_request_s=0.002).cost()
    assert cost.fixed_s == pytest.approx(0.010) and cost.per_token_s == pytest.approx(0.0005)
    assert cost.per_request_s == pytest.approx(0.002)
    single = _timer(0.010, 0.0005, 1).cost()  # batch 1 only: the per-request part is not separable
    assert single.per_request_s == 0.0 and single.fixed_s == pytest.approx(0.010)
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


def test_a_per_request_cost_that_batching_cannot_share_keeps_speculation_paying():
    # The same load as above, but each row costs 5 ms of its own (a CPU's per-row bookkeeping).
    model = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0005, batch=64, per_request_s=0.005), draft_ratio=0.1)
    assert model.best_block(0.5, 6) > 0


def test_low_acceptance_drafts_less_even_when_idle():
    model = LoadModel(_timer(fixed_s=0.010, per_token_s=0.001, batch=1), draft_ratio=0.3)
    assert model.best_block(0.2, 8) < model.best_block(0.9, 8)


def test_without_measurements_the_schedule_is_used_as_configured():
    assert LoadModel(PassTimer(), draft_ratio=0.5).best_block(0.1, 5) == 5


def test_a_budget_learns_from_its_rounds_and_keeps_exploring_long_blocks():
    idle = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0001, batch=1), draft_ratio=0.0)
    budget = DraftBudget(idle, max_block=6)
    assert budget.acceptance == 0.5 and budget.expected(3) == pytest.approx(expected_tokens(0.5, 3))
    for _ in range(20):
        k = budget()
        budget.observe(drafted=k, accepted=k)  # whole blocks accepted
    assert budget.chosen == [6] * 20
    assert budget.expected(6) == 7.0 and budget.expected(2) == 3.0  # measured: min(accepted, k) + 1
    for _ in range(40):  # now every draft fails
        k = budget()
        if k:
            budget.observe(drafted=k, accepted=0)
    assert budget.expected(4) == 1.0 and budget.chosen[-1] == 0
    budget.model = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0005, batch=64), draft_ratio=0.1)
    caps = [budget() for _ in range(32)]
    assert caps.count(0) == 30 and caps.count(6) == 2  # plain decoding, one full block in 16 to re-check
