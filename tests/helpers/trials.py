"""A fake clock and a closed loop of requests for the trial of arms (engine.policies.trial) and the
batch's goodput it measures (engine.policies.load)."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

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


Speeds = dict[str, tuple[float, float]]


class ClosedLoop:
    """`streams` requests that start a round as soon as their last one ends; a round under arm a commits
    speed[a][0] tokens in speed[a][1] seconds (+-30%, seeded); `speed` may be a function of the time the
    round starts. `run` goes on from where the last run stopped, the same requests' rounds in flight."""

    def __init__(self, trial: ArmTrial, clock: Clock, streams: int, speed: Speeds | Callable[[float], Speeds]):
        self.trial, self.clock, self.speed = trial, clock, speed
        self.rng = random.Random(7)
        self.heap: list = []
        for i in range(streams):
            self._start(i)

    def _start(self, i: int) -> None:
        round_ = self.trial.start_round()
        speed = self.speed(self.clock.t) if callable(self.speed) else self.speed
        tokens, duration = speed[round_.arm]
        heapq.heappush(self.heap, (self.clock.t + duration * self.rng.uniform(0.7, 1.3), i, round_, tokens))

    def run(self, seconds: float) -> dict[str, int]:
        """The rounds that ended in the next `seconds`, by arm."""
        used: dict[str, int] = {}
        end = self.clock.t + seconds
        while self.clock.t < end:
            self.clock.t, i, round_, tokens = heapq.heappop(self.heap)
            self.trial.end_round(round_, tokens)
            used[round_.arm] = used.get(round_.arm, 0) + 1
            self._start(i)
        return used


def closed_loop(
    trial: ArmTrial, clock: Clock, streams: int, speed: Speeds | Callable[[float], Speeds], seconds: float
) -> dict[str, int]:
    """`seconds` of a fresh ClosedLoop: the rounds run under each arm."""
    return ClosedLoop(trial, clock, streams, speed).run(seconds)


def ragged_timer(fixed_s: float, per_request_s: float, per_token_s: float, batch: int) -> PassTimer:
    """A ragged model's passes (every row joins and pays its own tokens) of `batch` and `batch - 1` rows."""
    timer = PassTimer(min_passes=4)
    timer.ragged = True
    for requests in (batch, batch, batch - 1, batch):
        for n in (1, 3):
            timer.record(requests, requests * n, fixed_s + per_request_s * requests + per_token_s * requests * n, n)
    return timer
