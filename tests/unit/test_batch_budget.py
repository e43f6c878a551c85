"""The verification budget per batch (engine.policies.load): one price, the batch's measured goodput,
for every request's drafts."""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Sequence

import pytest

from cascade_service.engine.policies.load import BySampling, LoadModel, expected_tokens
from tests.helpers.trials import UNTIMED, Clock, closed_loop, ragged_timer

BUDGET = ("budget",)


def _batch_rate(
    acceptances: Sequence[float], fixed_s: float, per_request_s: float, per_token_s: float, draft_s: float, ks
) -> float:
    """A batch's tokens per second where request i drafts ks[i] tokens, each kept with probability
    acceptances[i] until the first miss."""
    rows = sum(per_request_s + per_token_s * (k + 1) + draft_s * k for k in ks)
    return sum(expected_tokens(a, k) for a, k in zip(acceptances, ks)) / (fixed_s + rows)


def test_one_price_for_the_batch_finds_the_batchs_best_verification_budget():
    # The oracle: every allocation of k_i drafts to the batch's requests, enumerated, scored by the
    # batch's tokens per second, sum E_i(k_i) / (F + the rows' own parts and tokens + drafting +
    # the Python around the passes). Each round's measured goodput becomes the next round's price
    # (Dinkelbach's iteration); its fixed point must be the enumeration's best, where each request
    # maximizing its own tokens per second of its row falls short.
    rng = random.Random(3)
    shortfalls = []
    for _ in range(60):
        fixed, per_request, per_token = rng.uniform(0.002, 0.05), rng.uniform(0, 0.005), rng.uniform(1e-4, 5e-3)
        draft_s, python_s, offered = rng.uniform(0, 0.005), rng.uniform(0, 0.02), 5
        acceptances = [rng.uniform(0.05, 0.98) for _ in range(rng.randint(2, 4))]
        model = LoadModel(
            ragged_timer(fixed, per_request, per_token, len(acceptances)), offered, arms=BUDGET, clock=UNTIMED
        )
        batch_rate = functools.partial(_batch_rate, acceptances, fixed + python_s, per_request, per_token, draft_s)
        best = max(batch_rate(ks) for ks in itertools.product(range(offered + 1), repeat=len(acceptances)))
        price = batch_rate([0] * len(acceptances))  # the batch decoding plainly
        for _ in range(10):
            price = batch_rate([model.best_block(a, offered, draft_s, goodput=price) for a in acceptances])
        assert price == pytest.approx(best, rel=1e-9)
        shortfalls.append(batch_rate([model.best_block(a, offered, draft_s) for a in acceptances]) / best)
    assert min(shortfalls) < 0.9  # per-request ratios: down to 0.81 of the best on these batches


def test_at_the_batchs_price_poor_drafts_stop_and_good_ones_go_on():
    clock = Clock()
    model = LoadModel(ragged_timer(0.010, 0.001, 0.0015, 8), max_block=6, arms=BUDGET, clock=clock)
    model.WARMUP = 0
    good, poor = model.budget(), model.budget()
    assert model.goodput() is None  # no round has taken any time yet
    for i in range(30):  # rounds that take no time: evidence, no goodput
        for budget, accepted in ((good, 6), (poor, 2 * (i % 2))):  # the poor one: 0, 2, 0, 2, ...
            budget("lookup", 6)
            budget.observe(drafted=6, accepted=accepted)
    # Without a measured goodput each judges by its own row's tokens per second: the poor one verifies
    # two drafts, one kept in two rounds.
    assert model.goodput() is None and good("lookup", 6) == 6 and poor("lookup", 6) == 2
    good.observe(6, 6)
    poor.observe(6, 0)
    # 8 streams of rounds that commit 3 tokens in 50 ms each: ~480 tokens a second for the batch
    closed_loop(model.trial, clock, 8, {"budget": (3, 0.05)}, 60)
    assert 0.95 * 480 <= model.goodput() <= 1.05 * 480
    # A drafted token costs the batch 1.5 ms of its pass, ~0.72 of its tokens: one always kept pays, one
    # kept in two rounds does not.
    assert good("lookup", 6) == 6
    assert poor("lookup", 6) == 0


def test_greedy_and_sampled_rounds_price_the_same_passes():
    clock = Clock()
    timer = ragged_timer(0.010, 0.001, 0.002, 8)
    both = BySampling(lambda: LoadModel(timer, max_block=6, arms=BUDGET, clock=clock))
    closed_loop(both.models[True].trial, clock, 4, {"budget": (2, 0.05)}, 30)
    greedy_only = both.models[True].goodput()
    assert greedy_only is not None and both.models[False].goodput() == pytest.approx(greedy_only)
    closed_loop(both.models[False].trial, clock, 4, {"budget": (1, 0.05)}, 30)
    sampled = both.models[False].trial.goodput()
    assert sampled is not None and both.models[True].goodput() == pytest.approx(greedy_only + sampled, rel=0.01)
