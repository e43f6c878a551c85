"""A fake clock and a closed loop of requests for the trial of arms (engine.policies.trial) and the
batch's goodput it measures (engine.policies.load)."""

from __future__ import annotations

import heapq
import random

from cascade_service.engine.clock import PassTimer
from cascade_service.engine.policies.trial import ArmTrial


def UNTIMED() -> float:
    """A trial clock that never moves: no round has a duration, so no batch goodput is measured and
    each request's budget maximizes its own row's tokens per second."""
    return 0.0


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def closed_loop(
    trial: ArmTrial, clock: Clock, streams: int, speed: dict[str, tuple[int, float]], seconds: float
) -> dict[str, int]:
    """`streams` requests that start a round as soon as their last one ends; a round under arm a commits
    speed[a][0] tokens in speed[a][1] seconds (+-30%, seeded). Returns the rounds run under each arm."""
    rng = random.Random(7)
    used: dict[str, int] = {}
    heap: list = []

    def start(i: int) -> None:
        round_ = trial.start_round()
        tokens, duration = speed[round_.arm]
        heapq.heappush(heap, (clock.t + duration * rng.uniform(0.7, 1.3), i, round_, tokens))

    for i in range(streams):
        start(i)
    end = clock.t + seconds
    while clock.t < end:
        clock.t, i, round_, tokens = heapq.heappop(heap)
        trial.end_round(round_, tokens)
        used[round_.arm] = used.get(round_.arm, 0) + 1
        start(i)
    return used


def ragged_timer(fixed_s: float, per_request_s: float, per_token_s: float, batch: int) -> PassTimer:
    """A ragged model's passes (every row joins and pays its own tokens) of `batch` and `batch - 1` rows."""
    timer = PassTimer(min_passes=4)
    timer.ragged = True
    for requests in (batch, batch, batch - 1, batch):
        for n in (1, 3):
            timer.record(requests, requests * n, fixed_s + per_request_s * requests + per_token_s * requests * n, n)
    return timer
