"""What a batched forward pass costs: a request's compute clock (`TaskClock`, `charged`: its share of
each pass and its own work around them) and the timer that fits a pass's cost from recent passes
(`PassTimer`). Load adaptation (`engine.policies.load`) prices a round with them; the engine loop
(`models.loop`) feeds them."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy

PAD_WASTE = 1.5  # a batched pass processes at most this many padded positions per real one (models/batching.py)
# What a row costs a batched pass whatever its cache's length, in cached positions (its bookkeeping, its
# own tensors): so short caches of different lengths still share a pass. On the demo zoo's large model
# (CPU) 16 one-token rows took 35 ms over 32 cached positions each and 65 ms over 256, one row 12.6 ms:
# ~1.2 ms a row against ~8.5 us a cached position a row, a row worth ~150 positions. Rounded up, since
# each pass also pays a fixed part that joining shares; on a GPU positions are cheaper still.
ROW_POSITIONS = 256


@dataclass
class TaskClock:
    """Where one engine loop task's time went, in seconds (models.loop): `run_s` on the loop outside
    forward passes (its Python: the cascade's bookkeeping, MaG, reviews, sampling), `pass_s` its
    share of each model's batched passes, by model name; `blocked_s` parked on calls outside the loop
    (a remote tier's reply, the session store: models.loop.run_blocking); `started` when it was
    submitted (perf_counter); `stepping_since` when its current step on the loop began (None between
    steps)."""

    started: float = field(default_factory=time.perf_counter)
    run_s: float = 0.0
    pass_s: dict[str, float] = field(default_factory=dict)
    blocked_s: float = 0.0
    stepping_since: float | None = None

    @property
    def passes_s(self) -> float:
        return sum(self.pass_s.values())

    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def ran_s(self) -> float:
        """run_s, with the step under way counted so far."""
        since = self.stepping_since
        return self.run_s + (time.perf_counter() - since if since is not None else 0.0)

    def mark(self) -> tuple[float, float, dict[str, float]]:
        """Where the clock stands (wall, run, passes by model): a request that is part of a longer task
        (a benchmark's) counts its time from here (`since`)."""
        return time.perf_counter(), self.ran_s(), dict(self.pass_s)

    def since(self, mark: tuple[float, float, dict[str, float]]) -> tuple[dict[str, float], float, float]:
        """(passes by model, run, waited) seconds since `mark`."""
        began, ran, passes = mark
        pass_s = {name: s - passes.get(name, 0.0) for name, s in self.pass_s.items() if s > passes.get(name, 0.0)}
        run_s = self.ran_s() - ran
        return pass_s, run_s, max(0.0, time.perf_counter() - began - run_s - sum(pass_s.values()))

    def waited_s(self) -> float:
        """Wall time neither running nor in its own passes: its turn, others' passes, remote replies."""
        return max(0.0, self.wall_s() - self.ran_s() - self.passes_s)


# The clock of the engine loop task running now (each greenlet has its own context).
CURRENT_CLOCK: ContextVar[TaskClock | None] = ContextVar("cascade_task_clock", default=None)


def charged() -> float:
    """The current request's compute clock: its shares of the forward passes it took part in, plus the
    time it ran outside them (the cascade's own work: MaG, reviews, sampling).

    The difference over a round's drafting is what drafting cost: its share of each batched pass
    rather than the wall time it waited (which counts other requests' work as its own and would make
    drafting look dear exactly when the machine is busy), and the Python around the passes, which on
    a CPU is not small. Outside an engine loop task, the calling thread's CPU time.
    """
    clock = CURRENT_CLOCK.get()
    if clock is None:
        return time.thread_time()
    return clock.ran_s() + clock.passes_s


def waited() -> float:
    """The wall clock a request's rounds are judged by (engine.policies.floor): from the start of one target
    round to the next, everything the request waited through, its own passes and Python, its turn,
    the other requests' passes in the loop iterations its drafting spanned, remote replies. Drafter
    steps go before the target's next pass (engine.scheduler.turns), but a drafter nearly as dear as its
    target, or a long read past what the target lets go first, spans iterations: a round whose drafter
    steps span k of them waits through k of everyone's target passes, which its shares of the passes
    (`charged`) leave out, and which made drafting look cheap under load while the request ran slower
    than plain. Plain rounds are timed by the same clock, so the two compare at the same load."""
    return time.perf_counter()


def work_clock(clock: Callable[[], float], compute: Callable[[], float] | None = None) -> Callable[[], float]:
    """The work clock beside a round's `clock` (engine.policies: the floor, a resting request): `compute`
    where given; beside `waited`, the request's own work (`charged`: its shares of the passes and its
    Python); beside a test's clock of its own, that clock (a request alone waits for nothing else)."""
    if compute is not None:
        return compute
    return charged if clock is waited else clock


@dataclass(frozen=True)
class PassCost:
    """A forward pass over R requests and T tokens takes fixed_s + per_request_s * R + per_token_s * T.

    fixed_s is what batching shares (reading the weights, launching the pass); per_request_s is what
    it does not (each row's own cache and bookkeeping); per_token_s is the compute.
    """

    fixed_s: float
    per_request_s: float
    per_token_s: float


class PassTimer:
    """Recent (requests, tokens, seconds) of one model's passes, fitted to a PassCost by least squares.

    `row_seconds` prices a row of a given length against the same window. Thread-safe; the fit is
    redone at most every REFIT passes (a round asks for it, and rounds outnumber passes).
    """

    REFIT = 32  # a least-squares fit costs ~0.5 ms on a CPU; the cost it finds moves slowly

    def __init__(self, window: int = 256, min_passes: int = 16):
        # (requests, new tokens in all, seconds, the longest row's new tokens)
        self._passes: deque[tuple[int, int, float, int]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.min_passes = min_passes
        self._recorded = 0
        # (at _recorded, cost, {n: a row of n tokens' expected seconds}, the passes fitted): replaced
        # whole, so the many readers per pass need no lock
        self._fitted: tuple[int, PassCost | None, dict[int, float], list] = (-1, None, {}, [])
        self.ragged = False  # the model's passes are ragged (engine.scheduler.take_batch): no padding

    def shares(self, tokens: Sequence[int], seconds: float) -> list[float]:
        """Split a pass's `seconds` among its rows by the fitted cost: fixed part evenly, the rest by
        tokens (by tokens alone before a fit). A lone row's is the whole pass: no fit is read (a refit
        every REFIT passes cost a one-stream round ~15 us a pass)."""
        if len(tokens) == 1:
            return [seconds]
        cost = self.cost()
        if cost is None:
            weights = [float(t) for t in tokens]
        else:
            each = cost.fixed_s / len(tokens) + cost.per_request_s
            weights = [each + cost.per_token_s * t for t in tokens]
        total = sum(weights)
        return [seconds * w / total if total > 0 else seconds / len(tokens) for w in weights]

    def record(self, requests: int, tokens: int, seconds: float, longest: int | None = None) -> None:
        """A pass over `requests` rows, `tokens` new tokens in all, the longest row `longest` of them."""
        with self._lock:
            longest = longest if longest is not None else -(-tokens // max(requests, 1))
            self._passes.append((requests, tokens, seconds, longest))
            self._recorded += 1

    def row_seconds(self, n: int) -> float | None:
        """What a row of n new tokens is expected to cost a pass: its share of the fixed part, its own
        part and its positions, padding included. Averaged over the recent passes, each one priced as
        the batcher would have treated the row: joined to it where `take_batch` allows (the fixed part
        shared by one more row, the row padded to the pass's longest), otherwise alone. So a one-token
        plain step is cheap among one-token steps, dear beside twenty-token verifications it must be
        padded to or cannot join. None before a cost is fitted."""
        fitted = self._fit()
        if fitted[1] is None:
            return None
        seconds = fitted[2].get(n)
        if seconds is None:  # priced on demand, once per fit: most fits are only read by `shares`
            seconds = fitted[2][n] = _row_seconds(fitted[1], fitted[3], n, self.ragged)
        return seconds

    def cost(self) -> PassCost | None:
        """The fitted cost, or None before enough passes of at least two token counts were seen.

        Without passes of different batch sizes the per-request term cannot be told from the fixed
        one; it is then 0 (all of it counted as fixed).
        """
        return self._fit()[1]

    def _fit(self) -> tuple[int, PassCost | None, dict[int, float], list]:
        fitted = self._fitted
        if fitted[0] >= 0 and self._recorded - fitted[0] < self.REFIT:
            return fitted
        with self._lock:
            passes, recorded = list(self._passes), self._recorded
        fitted = (recorded, _least_squares(passes, self.min_passes), {}, passes)
        self._fitted = fitted
        return fitted


def _row_seconds(cost: PassCost, passes: list[tuple[int, int, float, int]], n: int, ragged: bool = False) -> float:
    """A row of n tokens' expected cost over recent passes (see PassTimer.row_seconds); in a ragged
    model's passes a row always joins and costs its own tokens."""
    alone = cost.fixed_s + cost.per_request_s + cost.per_token_s * n
    if not passes:
        return alone
    total = 0.0
    for requests, tokens, _, longest in passes:
        # The pass less one average row is what the other requests would bring (a pass of one row
        # was this request's own: there is nobody to share with).
        others, their_tokens = requests - 1, tokens - tokens / requests
        width = n if ragged else max(longest, n)
        if others > 0 and (ragged or pads_within(others + 1, width, their_tokens + n)):  # take_batch would join
            total += cost.fixed_s / (others + 1) + cost.per_request_s + cost.per_token_s * width
        else:
            total += alone
    return total / len(passes)


def pads_within(rows: int, padded: int, real: float) -> bool:
    """Whether `rows` rows each padded to `padded` positions hold at most PAD_WASTE per `real` one."""
    return rows * padded <= PAD_WASTE * real


def _least_squares(passes: list[tuple[int, int, float, int]], min_passes: int) -> PassCost | None:
    if len(passes) < min_passes or len({t for _, t, _, _ in passes}) < 2:
        return None
    rows_vary = len({r for r, _, _, _ in passes}) > 1
    # numpy's, not torch's: the same solve, a tenth of the time (the fit runs on the engine loop's thread)
    x = numpy.array([[1.0, r, t] if rows_vary else [1.0, t] for r, t, _, _ in passes], dtype=numpy.float64)
    y = numpy.array([s for _, _, s, _ in passes], dtype=numpy.float64)
    coef = _non_negative(x, y)
    return PassCost(coef[0], coef[1], coef[2]) if rows_vary else PassCost(coef[0], 0.0, coef[1])


def _non_negative(x: numpy.ndarray, y: numpy.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0: a term whose coefficient comes out negative is dropped
    and the rest refitted (an active set; three terms at most). Clipping instead kept the others' values
    from the fit that needed the negative one: at 16 streams, rows between 14 and 16 (the per-row term all
    but unidentifiable), the unclipped fit read 12.0 ms - 0.43 ms a row + 0.13 ms a token, clipped 12.0 ms
    fixed for passes of 7 ms; shares weighed by it charged a 10-draft verification row a fifth of what
    its tokens added to the pass (refitted: 5.3 ms + 0.127 ms a token)."""
    kept = list(range(x.shape[1]))
    coef = numpy.zeros(x.shape[1])
    while kept:
        solved = numpy.linalg.lstsq(x[:, kept], y, rcond=None)[0]
        if (solved >= 0.0).all():
            coef[kept] = solved
            break
        del kept[int(numpy.argmin(solved))]
    return [float(c) for c in coef]
