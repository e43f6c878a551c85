"""Load-adaptive speculation (engine.policies.load): the EWIF trade, measured terms, per-request acceptance."""

from __future__ import annotations

import pytest

from cascade_service.config import ConfigError
from cascade_service.engine.clock import PassTimer
from cascade_service.engine.policies.load import BySampling, DraftBudget, LoadModel, expected_tokens
from tests.helpers.trials import UNTIMED

BUDGET = ("budget",)  # the cost model alone decides (no trial of arms)


def _timer(
    fixed_s: float, per_token_s: float, batch: int, per_request_s: float = 0.0, rows: tuple[int, ...] = (1, 1, 2, 1)
) -> PassTimer:
    """Passes of `batch` requests (one of `batch - 1`, so the per-request part can be fitted), every row
    of a pass as long as the next entry of `rows`."""
    timer = PassTimer(min_passes=4)
    shapes = [(batch, n) for n in rows] + [(batch - 1 or 1, 4)]
    for requests, n in shapes:
        timer.record(requests, requests * n, fixed_s + per_request_s * requests + per_token_s * requests * n, n)
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
    model = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0001, batch=1), max_block=6, arms=BUDGET, clock=UNTIMED)
    assert model.best_block(0.8, 6, draft_s_per_token=0.002) == 6


def test_stop_speculating_when_the_batch_makes_passes_compute_bound():
    # 64 requests share the fixed part and step one token at a time: a row with drafts would be too
    # long to join their passes (the batcher's padding rule) and would pay a pass of its own.
    model = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0005, batch=64), max_block=6, arms=BUDGET, clock=UNTIMED)
    assert model.best_block(0.5, 6, draft_s_per_token=0.0001) == 0
    assert model.best_block(0.95, 6, draft_s_per_token=0.0001) == 0
    # The same load, but the others verify 4-token rows: a plain step would be padded to 4 anyway, so
    # good drafts pay, up to the longest row that still joins their passes.
    drafting = LoadModel(
        _timer(fixed_s=0.020, per_token_s=0.0005, batch=64, rows=(4, 4, 4, 4)), max_block=6, arms=BUDGET
    )
    assert 3 <= drafting.best_block(0.95, 6, draft_s_per_token=0.0001) <= 5  # 6 drafts no longer join
    assert drafting.timer.row_seconds(1) == pytest.approx(drafting.timer.row_seconds(4))


def test_low_acceptance_or_dear_drafting_drafts_less_even_when_idle():
    model = LoadModel(_timer(fixed_s=0.010, per_token_s=0.001, batch=1), max_block=8, arms=BUDGET, clock=UNTIMED)
    assert model.best_block(0.2, 8, 0.003) < model.best_block(0.9, 8, 0.003)
    assert model.best_block(0.9, 8, draft_s_per_token=0.05) < model.best_block(0.9, 8, draft_s_per_token=0.0)


def test_without_measurements_the_schedule_is_used_as_configured():
    assert (
        LoadModel(PassTimer(), max_block=5, arms=BUDGET, clock=UNTIMED).best_block(0.1, 5, draft_s_per_token=1.0) == 5
    )


def test_a_budget_learns_from_its_rounds_and_keeps_exploring_long_blocks():
    idle = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0001, batch=1), max_block=6, arms=BUDGET, clock=UNTIMED)
    budget = idle.budget()
    assert budget.expected("lookup", 3) == pytest.approx(expected_tokens(DraftBudget.NEUTRAL, 3))
    for _ in range(20):
        k = budget("lookup", 6)
        budget.observe(drafted=k, accepted=k)  # whole blocks accepted
    assert budget.chosen == [6] * 20
    assert budget.expected("lookup", 6) == pytest.approx(7.0) and budget.expected("lookup", 2) == pytest.approx(3.0)
    for _ in range(60):  # now every draft fails
        k = budget("lookup", 6)
        budget.observe(drafted=k, accepted=0)
    assert budget.expected("lookup", 4) < 1.5
    assert budget.chosen[-1] == 6  # idle: a pass costs mostly its fixed part, so even rare hits pay
    budget.model = LoadModel(
        _timer(fixed_s=0.020, per_token_s=0.0005, batch=64), max_block=6, arms=BUDGET, clock=UNTIMED
    )
    budget.model.WARMUP = 0
    caps = [budget("lookup", 6) for _ in range(32)]
    assert caps.count(0) == 30 and caps.count(6) == 2  # plain decoding, one full block in 16 to re-check


def _traffic(model: LoadModel, source: str, offered: int, accepted: int, requests: int = 8, rounds: int = 6) -> None:
    for _ in range(requests):
        budget = model.budget()
        for _ in range(rounds):
            k = budget(source, offered)
            budget.observe(drafted=k, accepted=min(k, accepted))


def test_a_new_request_starts_from_what_every_request_measured():
    # The slowdown this fixes: each request began at a neutral prior (E(k) <= 2), drafted 1, 2, 3...
    # tokens while it learned, and a 64-token request ended before it drafted a whole lookup block.
    idle = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0004, batch=1), max_block=20, arms=BUDGET, clock=UNTIMED)
    _traffic(idle, "lookup", 20, accepted=20)
    assert idle.budget()("lookup", 20) == 20  # a new request drafts the whole block at once
    busy = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0005, batch=64), max_block=20, arms=BUDGET, clock=UNTIMED)
    _traffic(busy, "lookup", 20, accepted=0)
    assert busy.budget()("lookup", 20) == 0  # ... or none, where every request's lookups failed


def test_greedy_and_sampled_traffic_keep_their_own_evidence_and_trial():
    # Sampled rounds whose lookups all fail must not stop greedy requests drafting theirs.
    timer = _timer(fixed_s=0.020, per_token_s=0.0004, batch=1)
    both = BySampling(lambda: LoadModel(timer, max_block=20, arms=BUDGET, clock=UNTIMED))
    assert both.models[True] is not both.models[False] and both.models[True].trial is not both.models[False].trial
    _traffic(both.models[False], "lookup", 20, accepted=0)
    _traffic(both.models[True], "lookup", 20, accepted=20)
    assert both.budget(False)("lookup", 20) == 0 and both.budget(True)("lookup", 20) == 20


def test_the_first_rounds_draft_as_configured_so_every_block_length_is_measured():
    busy = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0005, batch=64), max_block=8, arms=BUDGET, clock=UNTIMED)
    budget = busy.budget()
    caps = []
    for _ in range(busy.WARMUP):
        caps.append(budget("model", 8))
        budget.observe(drafted=caps[-1], accepted=8)
    assert caps == [8] * busy.WARMUP
    assert busy.population("model", 8)[0] > 0  # evidence on the longest block, too
    assert busy.budget()("lookup", 8) == 8  # each source warms up on its own


def test_a_lookup_is_never_charged_drafting_cost_but_model_drafts_are():
    idle = LoadModel(_timer(fixed_s=0.020, per_token_s=0.0004, batch=1), max_block=8, arms=BUDGET, clock=UNTIMED)
    for _ in range(40):
        budget = idle.budget()
        for source in ("lookup", "model"):
            budget(source, 8)
            budget.observe(drafted=8, accepted=8, draft_s=0.5)  # 60 ms of compute per drafted token
    assert idle.draft_cost("model") == pytest.approx(0.5 / 8)
    budget = idle.budget()
    assert budget("lookup", 8) == 8  # found already: trimming it saves nothing
    assert budget("model", 8) == 0  # drafting costs more than the tokens it wins


def test_a_term_the_fit_would_make_negative_is_dropped_and_the_rest_refitted():
    # Passes as at 16 streams: 14-16 rows, mostly one token each, the odd verification row of 11. The rows
    # barely vary, so their term is all but unidentifiable: these passes (measured on the demo family, T =
    # 0.7) fit exactly to 12 ms - 0.43 ms a row + 0.13 ms a token. Clipping the row's term to 0 left 12 ms
    # fixed for passes of 7-9 ms, and a pass's shares then charged a verification row a fifth of what its
    # tokens added.
    timer = PassTimer(min_passes=4)
    passes = [(16, 16), (15, 15), (14, 14), (16, 26), (15, 25), (16, 16), (14, 24), (16, 36)]
    for rows, tokens in passes:
        timer.record(rows, tokens, 0.012 - 0.00043 * rows + 0.00013 * tokens, tokens - rows + 1)
    cost = timer.cost()
    assert min(cost.fixed_s, cost.per_request_s, cost.per_token_s) >= 0.0
    predicted = [cost.fixed_s + cost.per_request_s * r + cost.per_token_s * t for r, t in passes]
    observed = [0.012 - 0.00043 * r + 0.00013 * t for r, t in passes]
    # Refitted with what is left, the fit is a least-squares fit again: it predicts the mean pass.
    assert sum(predicted) / len(passes) == pytest.approx(sum(observed) / len(passes), rel=1e-6)
    assert cost.per_token_s == pytest.approx(0.00013, rel=0.25)
    # So a verification row of 11 among 15 one-token rows is charged about its 10 extra tokens' time.
    seconds = observed[3]
    shares = timer.shares([1] * 15 + [11], seconds)
    assert shares[-1] - shares[0] == pytest.approx(10 * cost.per_token_s, rel=0.05)
    assert shares[-1] - shares[0] > 0.7 * 10 * 0.00013


def test_a_pass_is_charged_to_its_rows_by_the_fitted_cost():
    timer = _timer(fixed_s=0.010, per_token_s=0.001, batch=4, per_request_s=0.0)
    shares = timer.shares([1, 9], 0.030)
    assert sum(shares) == pytest.approx(0.030)
    assert shares[0] == pytest.approx(0.030 * 0.006 / 0.020)  # 5 ms of the fixed part + 1 ms of tokens
    assert PassTimer().shares([1, 3], 0.004) == pytest.approx([0.001, 0.003])  # no fit: by tokens


def test_a_lone_rows_pass_is_all_its_own_and_reads_no_fit(monkeypatch):
    import cascade_service.engine.clock as clock

    timer = _timer(fixed_s=0.010, per_token_s=0.001, batch=4, per_request_s=0.0)
    fits = []
    monkeypatch.setattr(clock, "_least_squares", lambda *args: fits.append(args))
    for _ in range(2 * PassTimer.REFIT):
        timer.record(1, 5, 0.015)
        assert timer.shares([5], 0.015) == [0.015]
    assert not fits
    timer.shares([1, 5], 0.02)  # a shared pass reads the fit: the timer refits when due
    assert len(fits) == 1


def test_the_compute_clock_is_the_current_tasks():
    import contextvars

    from cascade_service.engine.clock import CURRENT_CLOCK, TaskClock, charged

    clock = TaskClock(run_s=0.5, pass_s={"large": 0.25, "small": 0.125})

    def inside() -> float:
        CURRENT_CLOCK.set(clock)
        return charged()

    # A task's clock: its run time and its shares of passes, nothing of the thread it runs on.
    assert contextvars.copy_context().run(inside) == pytest.approx(0.875)
    assert CURRENT_CLOCK.get() is None  # set in that context only (each task greenlet has its own)
    clock.stepping_since = __import__("time").perf_counter() - 0.125  # a step under way counts so far
    assert contextvars.copy_context().run(inside) == pytest.approx(1.0, abs=0.01)


def test_a_row_is_priced_as_the_batcher_would_treat_it():
    # The slowdown this fixes: priced at the mean batch, short blocks looked cheap, though the batcher
    # does not put a one-token step into a pass of twenty-token rows (measured: 0.82x the K-matrix).
    timer = PassTimer(min_passes=4)
    fixed, per_token = 0.020, 0.0005
    for requests, n in ((16, 21), (15, 21), (16, 21), (1, 1)) * 4:
        timer.record(requests, requests * n, fixed + per_token * requests * n, n)
    cost = timer.cost()
    assert cost.fixed_s == pytest.approx(fixed) and cost.per_token_s == pytest.approx(per_token)

    # Each pass less one average row is what the others bring; the batcher would join a row of n
    # tokens to 16 (or 15) rows of 21 and pad it to 21 (16 x 21 <= 1.5 x (15 x 21 + n)); the one-row
    # pass was this request's own, so there the row runs alone.
    def priced(n: int) -> float:
        joined = 2 * (fixed / 16) + fixed / 15 + 3 * per_token * max(n, 21)
        return (joined + fixed + per_token * n) / 4

    assert timer.row_seconds(1) == pytest.approx(priced(1))
    assert timer.row_seconds(21) == pytest.approx(priced(21))
    assert timer.row_seconds(21) - timer.row_seconds(1) == pytest.approx(5 * per_token)  # padding: nearly free
    mean_batch = (16 + 15 + 16 + 1) / 4
    assert timer.row_seconds(1) > 5 * (fixed / mean_batch + per_token)  # the mean batch's price was far off
    model = LoadModel(timer, max_block=20, arms=BUDGET, clock=UNTIMED)
    assert model.best_block(0.6, 20) >= 5  # drafting is nearly free: a plain step is padded to 21 anyway


def test_an_arm_caps_every_round_and_only_drafting_rounds_teach_the_budget():
    busy = _timer(fixed_s=0.020, per_token_s=0.0005, batch=64)
    plain = LoadModel(busy, max_block=8, arms=("plain",))
    budget = plain.budget()
    for source in ("lookup", "model"):
        assert budget(source, 8) == 0
        budget.observe(drafted=0, accepted=0)
    assert plain.population("model", 0)[0] == 0.0 and plain.warming_up("model")  # no evidence from it
    lookup = LoadModel(busy, max_block=8, arms=("lookup",)).budget()
    assert lookup("model", 8) == 0
    lookup.observe(drafted=0, accepted=0)
    assert lookup("lookup", 8) == 8  # warming up: as offered
    full = LoadModel(busy, max_block=8, arms=("full",))
    full.WARMUP = 0
    budget = full.budget()
    assert budget("model", 8) == 8  # the cost model would say 0 at this load (see above); the arm says all
    budget.observe(drafted=8, accepted=2)
    assert full.population("model", 8)[0] > 0  # and the round is evidence for the budget arm
    with pytest.raises(ValueError, match="arms must be among"):
        LoadModel(busy, max_block=8, arms=("greedy",))


def test_the_ray_coordinator_tries_every_arm_but_the_cost_model():
    from cascade_service.config import MaGConfig, ModelTierConfig, ServingConfig, make_cascade
    from cascade_service.core.cascade import Lookup
    from cascade_service.serving.policies import coordinator_policies

    def load_budgets(cascade, arms=None):
        return coordinator_policies(cascade, ServingConfig(adapt_to_load=True, floor=False, load_arms=arms))

    cascade = make_cascade(
        ModelTierConfig("large", "/m/large"),
        [ModelTierConfig("small", "/m/small"), MaGConfig()],
        [[3, 1], [0, 2]],
        1.0,
        Lookup(2, 12),
    )
    budget = load_budgets(cascade)(True)
    # The coordinator cannot charge remote drafters' passes, so the cost model's arm is left out.
    assert budget.model.trial.arms == ("full", "lookup", "plain") and budget.model.max_block == 12
    # serving.load_arms narrows them, and cannot bring the cost model back in.
    assert load_budgets(cascade, ("plain", "lookup"))(False).model.trial.arms == ("plain", "lookup")
    with pytest.raises(ConfigError, match=r"serving\.load_arms: the Ray app cannot run the 'budget' arm"):
        load_budgets(cascade, ("full", "budget"))


def test_a_full_budget_leaves_the_ceiling_as_the_fixed_schedule_does():
    # A drafter that is itself a cascade returns more than its quota (its accepted tokens and bonus);
    # under the K-matrix the target keeps them up to the ceiling, and drafting everything must too.
    budget = LoadModel(PassTimer(), max_block=10, arms=("full",)).budget()
    budget.begin()
    assert budget.cap("model", 1, 9) == 9  # the target row's quota is 1; base's system may give up to 9
    budget.observe(5, 5)
    plain = LoadModel(PassTimer(), max_block=10, arms=("plain",)).budget()
    plain.begin()
    assert plain.cap("model", 1, 9) == 0  # an arm that drafts nothing still caps at nothing
    plain.observe(0, 0)


def test_a_round_its_arm_keeps_plain_never_reads_the_compute_clock(monkeypatch):
    # The compute clock is read where a source is first let draft: at 64 streams under the "plain" arm every
    # round asks both sources and drafts nothing, and reading it there was part of the policies' cost.
    from cascade_service.engine.policies import load

    reads = []
    monkeypatch.setattr(load, "charged", lambda: reads.append(1) or 10.0 * len(reads))
    busy = _timer(fixed_s=0.020, per_token_s=0.0005, batch=64)
    budget = LoadModel(busy, max_block=8, arms=("plain",)).budget()
    budget.begin()
    assert not budget.allows("lookup") and not budget.allows("model")
    budget.observe(drafted=0, accepted=0)
    assert reads == []
    full = LoadModel(busy, max_block=8, arms=("full",)).budget()
    full.begin()
    assert full.allows("lookup") and full.allows("model")  # read once, at the first
    assert full("model", 4) == 4
    full.drafted()
    assert len(reads) == 2 and full._draft_s == 10.0  # from the first allows to drafted: 20 - 10
