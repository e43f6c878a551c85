"""Which way of drafting the load rewards, found by experiment: a trial of arms.

engine.policies.load's cost model chooses each request's draft budget from what it can price. ArmTrial decides
between that and the blunter choices (the fixed K-matrix, MaG lookups only, no drafts) by measuring
what each does to the requests' speed at the current load.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...core.policy import ARMS


@dataclass
class _Epoch:
    """The rounds of one epoch that started once its window was open."""

    arm: str
    level: int
    window: float | None = None  # when rounds began to count (None: rounds of the arm before are in flight)
    closed: bool = False
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    pending: int = 0  # rounds started in it and not finished


class Goodput:
    """The batch's goodput: tokens committed per second of busy time (time with a round in flight), over about the
    last WINDOW_S busy seconds: the whole batch's tokens over the time they took. Each round's tokens per second
    of its own time, smoothed and times the rounds in flight, read a median 0.72 of the served throughput (16
    streams, the demo's family) and swung between 0.32 and 2.7 of it from one sample to the next. Idle time is
    not counted, so the rate a burst leaves is the price the next one starts from. ArmTrial updates it under its
    lock; `rate` may be read from any thread."""

    WINDOW_S = 10.0

    def __init__(self, now: float):
        self.in_flight = 0
        self._mark = now
        self._busy = 0.0  # busy seconds in all
        self._weighed = 0.0  # busy seconds already in the decayed sums
        self._sums = (0.0, 0.0)  # decayed (tokens, busy seconds), replaced whole: readers take no lock

    def tick(self, now: float, in_flight: int, after: int) -> None:
        """`in_flight` rounds ran from the last tick to `now`; `after` run from now on."""
        if in_flight > 0:
            self._busy += now - self._mark
        self._mark, self.in_flight = now, after

    def add(self, tokens: int) -> None:
        """A round ended, committing `tokens` (after its tick)."""
        elapsed, self._weighed = self._busy - self._weighed, self._busy
        decay = math.exp(-elapsed / self.WINDOW_S)
        old_tokens, old_seconds = self._sums
        self._sums = (old_tokens * decay + tokens, old_seconds * decay + elapsed)

    def rate(self) -> float | None:
        """Tokens per busy second; None before any busy time, or with no round in flight (nothing of
        this batch to price)."""
        tokens, seconds = self._sums
        if seconds <= 0.0 or self.in_flight <= 0:
            return None
        return tokens / seconds


@dataclass(frozen=True)
class Round:
    """A round as the trial knows it: pass it back to ArmTrial.end_round."""

    epoch: int
    arm: str
    started: float


class ArmTrial:
    """Which arm the next rounds use, chosen by how fast requests decode under each arm at this load.

    The cost model behind DraftBudget prices what it can see: the target's passes and each request's
    share of the drafters' passes. It cannot see all that drafting costs the others on a shared machine
    (drafter passes competing with target passes for the same cores, caches and memory bandwidth): on
    the 2-core demo host, sampling at temperature 1 with 16 streams, it priced a round of model drafts
    at about a plain step's worth when plain decoding was 20-25% faster. So whether to speculate, and
    with what, is settled by experiment, on what the load makes of it.

    Time runs in epochs; every round that starts in an epoch uses its arm. A round's measure is its
    wall time (from the start of the target's draft to its review), which includes waiting for the
    others' passes: that is where the cost the model misses shows. An epoch's window opens once the
    rounds of earlier epochs have finished (or after SETTLE_S), so its rounds share passes only with
    rounds of its own arm; rounds started in the window count, and the epoch closes once it has run
    EPOCH_S and counted MIN_ROUNDS (and as many as rounds in flight). Its sample, taken when its last
    round ends, is tokens committed per second of round time at its load level (log2 of rounds in
    flight, smoothed); one whose level moved is dropped. Per-request speed while decoding rather than
    tokens per wall second, since in a closed loop the two move together and the first does not dip
    when a wave of new requests is being prefilled.

    At level 0 (one round in flight) the K-matrix runs ("full"), with no trial: a lone request's passes
    cost what they cost when `tune` chose it. Each other level tries every arm once, then measures
    again each arm that came within NEAR of the best on a single sample (CONFIRM), then uses the best
    (the median of its last RECENT samples). A first sample can fall on a server still cold (its first
    batched passes, its allocator) or on a wave of new requests' prefills: in `bench load`, a fresh
    server's warm-up measured "full" and "budget" at 16 streams before its level began (62-75 tokens a
    round-second), and "lookup", measured warm (67-77), was kept for the rest of the level over both,
    never measured again. One
    epoch in EXPLORE re-measures another arm, the least recently measured, except that one measured at
    under half the best is re-measured only every FAR_EXPLORE-th time, so that a change in traffic is
    noticed.
    """

    EPOCH_S = 2.0
    SETTLE_S = 3.0
    MIN_ROUNDS = 8
    EXPLORE = 8
    FAR_EXPLORE = 4
    NEAR = 0.85  # an arm within this fraction of the best, measured once, is measured again (CONFIRM)
    CONFIRM = 2
    RECENT = 5  # an arm's estimate is the median of its last samples: an epoch that fell on a wave of
    # new requests (their prefills hold the passes) reads far low, and a mean would follow it
    LOAD_SMOOTHING = 0.05  # EWMA of rounds in flight, per round started
    STALE = 8  # epochs after which an epoch's unfinished rounds are written off (no round lasts this long)

    def __init__(self, arms: Sequence[str] = ARMS, clock: Callable[[], float] = time.monotonic):
        if not arms:
            raise ValueError("arms must not be empty")
        self.arms = tuple(arms)
        self.clock = clock
        self._lock = threading.Lock()
        self._epoch = 0
        self._epochs: dict[int, _Epoch] = {0: _Epoch(self.arms[0], 0)}  # current and still-pending ones
        self.arm = self.arms[0]  # the arm of the epoch under way (a round started now uses it); read lock-free
        self._in_flight = 0  # the epochs' pending rounds, summed (a written-off epoch's leave with it)
        self._started = clock()
        self._load = 1.0
        self.goodput_meter = Goodput(self._started)
        # level -> arm -> (median of its last RECENT samples, samples, index of the last sample)
        self.estimates: dict[int, dict[str, tuple[float, int, int]]] = {}
        self._recent: dict[tuple[int, str], deque[float]] = {}
        self._samples: dict[int, int] = {}  # level -> samples taken
        self._choices: dict[int, int] = {}  # level -> arms chosen there once all were measured
        self._explorations: dict[int, int] = {}

    def level(self) -> int:
        """The load level: log2 of the rounds in flight (smoothed), rounded."""
        return max(0, round(math.log2(max(self._load, 1.0))))

    def goodput(self) -> float | None:
        """The batch's measured goodput (Goodput.rate): the price of a second of anyone's passes
        (engine.policies.load)."""
        return self.goodput_meter.rate()

    def start_round(self) -> Round:
        with self._lock:
            now = self.clock()
            in_flight = self._in_flight
            self.goodput_meter.tick(now, in_flight, in_flight + 1)
            self._load += self.LOAD_SMOOTHING * (in_flight + 1 - self._load)
            self._advance(now)
            self._epochs[self._epoch].pending += 1
            self._in_flight += 1
            return Round(self._epoch, self._epochs[self._epoch].arm, now)

    def end_round(self, round_: Round, tokens: int) -> None:
        """`round_` committed `tokens` tokens."""
        with self._lock:
            now = self.clock()
            seconds = now - round_.started
            epoch = self._epochs.get(round_.epoch)
            in_flight = self._in_flight
            self.goodput_meter.tick(now, in_flight, in_flight - (epoch is not None))
            self.goodput_meter.add(tokens)
            if epoch is not None:
                epoch.pending -= 1
                self._in_flight -= 1
                if epoch.window is not None and round_.started >= epoch.window:
                    epoch.tokens += tokens
                    epoch.seconds += seconds
                    epoch.rounds += 1
                if epoch.closed and epoch.pending <= 0:
                    self._finish(round_.epoch)
            self._advance(now)

    def _advance(self, now: float) -> None:
        current = self._epochs[self._epoch]
        if current.window is None:
            settled = not any(e.pending > 0 for i, e in self._epochs.items() if i < self._epoch)
            if settled or now - self._started >= self.SETTLE_S:
                current.window = now
                current.level = self.level()
            return
        if now - current.window < self.EPOCH_S or current.rounds < max(self.MIN_ROUNDS, round(self._load)):
            return
        current.closed = True
        level = self.level()
        if level != current.level:
            current.level = -1  # the load moved under it: not a sample of either level
        if current.pending <= 0:
            self._finish(self._epoch)
        for stale in [i for i in self._epochs if i < self._epoch - self.STALE]:
            self._finish(stale)  # its unfinished rounds never will: what finished is its sample
        self._epoch += 1
        self._epochs[self._epoch] = _Epoch(self._choose(level), level)
        self.arm = self._epochs[self._epoch].arm
        self._started = now

    def _finish(self, index: int) -> None:
        epoch = self._epochs.pop(index)
        self._in_flight -= epoch.pending
        if epoch.rounds == 0 or epoch.seconds <= 0.0 or epoch.level < 0:  # nothing counted, or no level
            return
        rate = epoch.tokens / epoch.seconds
        arms = self.estimates.setdefault(epoch.level, {})
        index = self._samples.get(epoch.level, 0)
        self._samples[epoch.level] = index + 1
        recent = self._recent.setdefault((epoch.level, epoch.arm), deque(maxlen=self.RECENT))
        recent.append(rate)
        old = arms.get(epoch.arm)
        arms[epoch.arm] = (statistics.median(recent), (old[1] if old else 0) + 1, index)

    def _choose(self, level: int) -> str:
        if level == 0 and "full" in self.arms:
            # One round in flight: no batching to change what a pass costs, so the K-matrix, tuned
            # offline at one stream (`tune`), is the answer, and exploring other arms only costs.
            return "full"
        arms = self.estimates.get(level, {})
        pending = {e.arm for e in self._epochs.values() if not e.closed or e.pending > 0}
        untried = [a for a in self.arms if a not in arms and a not in pending]
        if untried:
            return untried[0]
        measured = [a for a in self.arms if a in arms]
        if not measured:  # every arm is in flight, none measured yet
            return self.arms[0]
        best = max(measured, key=lambda a: arms[a][0])
        unconfirmed = self._unconfirmed(arms, best, pending) if len(measured) == len(self.arms) else []
        if unconfirmed:  # every arm has a sample: the near ones get a second before the best is kept
            return min(unconfirmed, key=lambda a: arms[a][2])  # the least recently measured
        choice = self._choices[level] = self._choices.get(level, 0) + 1
        if choice % self.EXPLORE != 0 or len(measured) == 1:
            return best
        explorations = self._explorations[level] = self._explorations.get(level, 0) + 1
        others = [a for a in measured if a != best]
        near = [a for a in others if arms[a][0] >= 0.5 * arms[best][0]]
        if not near or explorations % self.FAR_EXPLORE == 0:
            near = others
        return min(near, key=lambda a: arms[a][2])  # the least recently measured

    def _unconfirmed(self, arms: dict[str, tuple[float, int, int]], best: str, pending: set[str]) -> list[str]:
        """The arms other than `best`, not in flight, within NEAR of it on fewer than CONFIRM samples."""
        near = self.NEAR * arms[best][0]
        return [
            a
            for a, (rate, samples, _) in arms.items()
            if a != best and a not in pending and samples < self.CONFIRM and rate >= near
        ]

    def best(self, level: int) -> str | None:
        """The arm in use at `level`; None until every arm was measured there."""
        arms = self.estimates.get(level, {})
        return max(arms, key=lambda a: arms[a][0]) if len(arms) == len(self.arms) else None
