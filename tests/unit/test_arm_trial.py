"""The trial of arms (engine.policies.trial.ArmTrial): which way of drafting the load rewards, found by
experiment."""

from __future__ import annotations

import math

import pytest

from cascade_service.engine.policies.trial import ARMS, ArmTrial, Goodput
from tests.helpers.trials import Clock, ClosedLoop, closed_loop

# (tokens per round, seconds per round): idle, drafting pays; loaded (on a CPU), plain steps are faster
IDLE = {"full": (6, 0.03), "budget": (5, 0.03), "lookup": (3, 0.02), "plain": (1, 0.015)}
LOADED = {"full": (3, 0.30), "budget": (2, 0.22), "lookup": (1.2, 0.1), "plain": (1, 0.07)}


def test_the_trial_measures_every_arm_then_keeps_the_fastest():
    clock = Clock()
    trial = ArmTrial(clock=clock)
    closed_loop(trial, clock, 16, LOADED, 60)
    assert trial.level() == 4  # 16 rounds in flight
    assert set(trial.estimates[4]) == set(ARMS) and trial.best(4) == "plain"
    assert trial.estimates[4]["plain"][0] == pytest.approx(1 / 0.07, rel=0.1)  # tokens per round-second
    used = closed_loop(trial, clock, 16, LOADED, 120)
    assert used["plain"] > 0.8 * sum(used.values())  # the rest: re-measuring the others now and then
    assert all(trial.estimates[4][arm][1] >= 2 for arm in ARMS)


def test_an_arm_near_the_best_on_one_sample_is_measured_again_before_the_best_is_kept():
    # A fresh server's first seconds at 16 streams are slow for every arm (first passes, allocator): the
    # arms measured then read low against those measured once it is warm. "full" is the fastest warm
    # (15 tokens a round-second against lookup's 13), read 11.5 cold: within NEAR of lookup's warm 13.
    warm = {"full": (3, 0.2), "budget": (2.4, 0.2), "lookup": (1.3, 0.1), "plain": (1, 0.08)}
    cold = {arm: (tokens, seconds / 0.75) for arm, (tokens, seconds) in warm.items()}
    clock = Clock()
    trial = ArmTrial(clock=clock)
    requests = ClosedLoop(trial, clock, 16, lambda t: cold if t < 7.5 else warm)
    requests.run(7.5)
    assert {arm for arm, (_, samples, _) in trial.estimates[4].items() if samples} == {"budget", "full"}
    requests.run(12)
    full = trial.estimates[4]["full"]
    assert full[1] >= 2 and trial.best(4) == "full"  # measured again warm, not left at its cold reading
    assert trial.estimates[4]["budget"][1] == 1  # far below the best (cold, and slower warm): no second sample yet
    used = requests.run(12)
    assert used["full"] > 0.8 * sum(used.values())


def test_at_one_stream_the_k_matrix_runs_and_nothing_is_explored():
    clock = Clock()
    trial = ArmTrial(clock=clock)
    used = closed_loop(trial, clock, 1, IDLE, 120)
    assert used == {"full": sum(used.values())}  # no round of another arm: the K-matrix's cost, no more
    assert set(trial.estimates[0]) == {"full"}
    # without the K-matrix among the arms, level 0 is a trial like any other
    other = ArmTrial(("lookup", "plain"), clock=clock)
    closed_loop(other, clock, 1, IDLE, 60)
    assert other.best(0) == "lookup"


def test_load_levels_are_judged_apart_and_a_change_in_traffic_is_followed():
    clock = Clock()
    trial = ArmTrial(clock=clock)
    closed_loop(trial, clock, 1, IDLE, 60)
    closed_loop(trial, clock, 16, LOADED, 120)
    assert set(trial.estimates[0]) == {"full"} and trial.best(4) == "plain"
    # The traffic changes (say, prompts the lookup copies whole): drafting pays again at 16 streams.
    closed_loop(trial, clock, 16, {**LOADED, "full": (12, 0.3)}, 240)
    assert trial.best(4) == "full"


def test_an_epoch_counts_only_rounds_that_share_passes_with_its_own_arm():
    clock = Clock()
    trial = ArmTrial(("lookup", "plain"), clock=clock)
    trial.EPOCH_S, trial.MIN_ROUNDS = 2.0, 2
    slow = trial.start_round()  # a long "lookup" round, still running when its epoch closes
    for _ in range(4):
        round_ = trial.start_round()
        clock.t += 0.5
        trial.end_round(round_, 6)
    early = trial.start_round()
    assert early.arm == "plain"  # epoch 0 closed: 2 s, 4 rounds counted
    clock.t += 1.0
    trial.end_round(early, 100)  # began beside the "lookup" round: not plain's sample
    clock.t += 1.0
    trial.end_round(slow, 6)  # epoch 0 ends: its sample is in
    assert trial.estimates[0]["lookup"][0] == pytest.approx(30 / 6.0)  # tokens per second of round time
    for _ in range(4):  # plain's window opened when the "lookup" round ended
        round_ = trial.start_round()
        clock.t += 0.5
        trial.end_round(round_, 1)
    assert trial.estimates[0]["plain"] == (pytest.approx(2.0), 1, 1)  # 4 tokens in 2 s; 100 left out


def test_a_round_that_never_ends_does_not_stall_the_trial():
    clock = Clock()
    trial = ArmTrial(("lookup", "plain"), clock=clock)
    for _ in range(8):
        trial.start_round()  # requests that failed mid-round: never ended
    closed_loop(trial, clock, 1, IDLE, 60)
    assert set(trial.estimates[0]) == {"lookup", "plain"}  # windows opened (SETTLE_S), the load forgot them
    assert trial.best(0) == "lookup"


def test_the_batchs_goodput_is_its_tokens_over_its_busy_time():
    clock = Clock()
    trial = ArmTrial(("plain",), clock=clock)
    first, second = trial.start_round(), trial.start_round()
    assert trial.goodput() is None  # nothing has ended
    clock.t = 1.0
    trial.end_round(first, 3)
    assert trial.goodput() == pytest.approx(3.0)  # 3 tokens in 1 busy second
    clock.t = 2.0
    trial.end_round(second, 5)
    assert trial.goodput() is None  # nothing in flight: no batch to price
    clock.t = 100.0  # idle: not counted
    third = trial.start_round()
    decay = math.exp(-1.0 / Goodput.WINDOW_S)  # the second second weighs the first down
    assert trial.goodput() == pytest.approx((3 * decay + 5) / (decay + 1))
    clock.t = 100.5
    trial.end_round(third, 2)
    half = math.exp(-0.5 / Goodput.WINDOW_S)
    assert trial.goodput() is None and trial.goodput_meter.rate() is None
    trial.start_round()
    assert trial.goodput() == pytest.approx(((3 * decay + 5) * half + 2) / ((decay + 1) * half + 0.5))
