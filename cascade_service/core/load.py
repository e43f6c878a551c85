"""Speculation that adapts to load (issue 7): each round's draft budget at the target, per request.

Speculation buys tokens per target pass with extra verified positions. That pays while a pass costs
mostly its fixed part (reading the weights, launching kernels, Python) and stops paying once the batch
is large enough that a pass costs mostly per token (compute-bound): then every rejected draft is
wasted work that other requests wait for. CS Drafting's EWIF (paper §3.2) makes the trade explicit;
here its terms are measured instead of assumed. For a round with at most k drafts:

    E(k)    = tokens the round yields: 1 + the mean of min(accepted, k) over recent rounds that
              offered at least k drafts (this request's, weighted against every request's)
    cost(k) = S + c (k + 1) + g k,   S = F / B + q

where a target pass over B requests and T tokens takes F + q B + c T seconds (fitted from the target's
recent batched passes), B is the mean batch at the target, and g is the measured drafting time per
drafted token. Only F is shared by batching: on a CPU the per-request part q (each row's cache and
bookkeeping) is large, and then speculation keeps paying under load. The budget is the k in
[0, offered] that maximizes E(k) / cost(k); k = 0 is plain decoding for that round.

A round's drafts come from one of two sources, judged apart since they behave apart:
- "lookup": MaG's n-gram continuation (the target's lookup gate). It is found before the budget is
  asked (its cost is spent, g = 0), and is right as a whole or not at all;
- "model": the K-matrix's drafters; the budget caps the block before any drafter runs.

A request starts from every request's evidence (LoadModel keeps it), so it speculates at the level the
traffic supports from its first round; its own rounds take over as they come (PRIOR_WEIGHT). The
first WARMUP rounds of each source draft all they are offered, so that evidence covers every k: a
cautious start would only ever learn about short blocks.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

SOURCES = ("lookup", "model")

_charged = threading.local()


def charge(seconds: float) -> None:
    """Add to the calling thread's compute clock: its share of a (batched) forward pass it waited for."""
    _charged.seconds = getattr(_charged, "seconds", 0.0) + seconds


def charged() -> float:
    """The calling thread's compute clock: seconds of forward passes charged to it so far.

    A request decodes in one thread, so the difference over a round is the compute its drafting took,
    its share of each batched pass rather than the wall time it waited (which counts other requests'
    work as its own and would make drafting look dear exactly when the machine is busy).
    """
    return getattr(_charged, "seconds", 0.0)


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

    `batch` is the mean number of requests per pass over the same window. Thread-safe; the fit is
    redone at most every REFIT passes (a round asks for it, and rounds outnumber passes).
    """

    REFIT = 8

    def __init__(self, window: int = 256, min_passes: int = 16):
        self._passes: deque[tuple[int, int, float]] = deque(maxlen=window)  # (requests, tokens, seconds)
        self._lock = threading.Lock()
        self.min_passes = min_passes
        self._recorded = 0
        self._fitted: tuple[int, PassCost | None, float] = (-1, None, 1.0)  # (at _recorded, cost, batch)

    def shares(self, tokens: Sequence[int], seconds: float) -> list[float]:
        """Split a pass's `seconds` among its rows by the fitted cost: fixed part evenly, the rest by
        tokens (by tokens alone before a fit)."""
        cost = self.cost()
        if cost is None:
            weights = [float(t) for t in tokens]
        else:
            each = cost.fixed_s / len(tokens) + cost.per_request_s
            weights = [each + cost.per_token_s * t for t in tokens]
        total = sum(weights)
        return [seconds * w / total if total > 0 else seconds / len(tokens) for w in weights]

    def record(self, requests: int, tokens: int, seconds: float) -> None:
        with self._lock:
            self._passes.append((requests, tokens, seconds))
            self._recorded += 1

    def batch(self) -> float:
        return self._fit()[2]

    def cost(self) -> PassCost | None:
        """The fitted cost, or None before enough passes of at least two token counts were seen.

        Without passes of different batch sizes the per-request term cannot be told from the fixed
        one; it is then 0 (all of it counted as fixed).
        """
        return self._fit()[1]

    def _fit(self) -> tuple[int, PassCost | None, float]:
        with self._lock:
            if self._fitted[0] >= 0 and self._recorded - self._fitted[0] < self.REFIT:
                return self._fitted
            passes, recorded = list(self._passes), self._recorded
        batch = sum(r for r, _, _ in passes) / len(passes) if passes else 1.0
        fitted = (recorded, _least_squares(passes, self.min_passes), batch)
        with self._lock:
            self._fitted = fitted
        return fitted


def _least_squares(passes: list[tuple[int, int, float]], min_passes: int) -> PassCost | None:
    if len(passes) < min_passes or len({t for _, t, _ in passes}) < 2:
        return None
    rows_vary = len({r for r, _, _ in passes}) > 1
    x = torch.tensor([[1.0, float(r), float(t)] if rows_vary else [1.0, float(t)] for r, t, _ in passes],
                     dtype=torch.float64)
    y = torch.tensor([[s] for _, _, s in passes], dtype=torch.float64)
    coef = [max(float(c), 0.0) for c in torch.linalg.lstsq(x, y).solution.flatten()]
    return PassCost(coef[0], coef[1], coef[2]) if rows_vary else PassCost(coef[0], 0.0, coef[1])


class Evidence:
    """Decayed per-k sums over rounds: for each k, how many rounds offered >= k drafts (weight) and the
    sum of min(accepted, k) over them. A round offering `cap` drafts is evidence for every k <= cap,
    since a block capped at k is the first k drafts of the longer one. O(cap) per round, O(1) per read.
    """

    def __init__(self, size: int, decay: float):
        self.weight = [0.0] * (size + 1)
        self.accepted = [0.0] * (size + 1)
        self.decay = decay

    def add(self, cap: int, accepted: int) -> None:
        d = self.decay
        self.weight = [w * d for w in self.weight]
        self.accepted = [a * d for a in self.accepted]
        for k in range(min(cap, len(self.weight) - 1) + 1):
            self.weight[k] += 1.0
            self.accepted[k] += min(accepted, k)

    def at(self, k: int) -> tuple[float, float]:
        """(weight, mean of min(accepted, k)); weight 0 where no round offered k drafts."""
        if k >= len(self.weight) or self.weight[k] <= 0.0:
            return 0.0, 0.0
        return self.weight[k], self.accepted[k] / self.weight[k]


class LoadModel:
    """What every request's budget consults: the target's pass cost and batch size, the measured
    drafting cost, and every request's recent rounds (the prior a new request starts from)."""

    POPULATION_DECAY = 1.0 - 1.0 / 256  # every request's rounds: half-weight after ~180 rounds
    WARMUP = 32  # a source's first rounds draft all they are offered: evidence on every k to start from
    DRAFT_SMOOTHING = 0.05  # EWMA of drafting seconds per drafted token

    def __init__(self, timer: PassTimer, max_block: int):
        if max_block < 0:
            raise ValueError(f"max_block must be >= 0, got {max_block}")
        self.timer = timer
        self.max_block = max_block
        self._lock = threading.Lock()
        self._population = {s: Evidence(max_block, self.POPULATION_DECAY) for s in SOURCES}
        self._draft_s_per_token = {s: 0.0 for s in SOURCES}  # 0 until measured: drafting looks free
        self._rounds = 0
        self._observed = {s: 0 for s in SOURCES}

    def budget(self) -> "DraftBudget":
        return DraftBudget(self)

    def warming_up(self, source: str) -> bool:
        return self._observed[source] < self.WARMUP

    def population(self, source: str, k: int) -> tuple[float, float]:
        with self._lock:
            return self._population[source].at(k)

    def explore_now(self) -> bool:
        """True for one round in DraftBudget.EXPLORE across all requests (short requests explore too)."""
        with self._lock:
            self._rounds += 1
            return self._rounds % DraftBudget.EXPLORE == 0

    def draft_cost(self, source: str) -> float:
        return self._draft_s_per_token[source]

    def observe(self, source: str, cap: int, accepted: int, drafted: int, draft_s: float) -> None:
        with self._lock:
            self._population[source].add(cap, accepted)
            self._observed[source] += 1
            if drafted > 0:
                old, new = self._draft_s_per_token[source], draft_s / drafted
                self._draft_s_per_token[source] = new if old == 0.0 else old + self.DRAFT_SMOOTHING * (new - old)

    def best_block(self, expected: Callable[[int], float] | float, offered: int, draft_s_per_token: float = 0.0) -> int:
        """The k in [0, offered] with the most tokens per second; `expected(k)` is the tokens a round
        with at most k drafts yields (a float: per-token acceptance, the geometric model)."""
        if not callable(expected):
            acceptance = expected
            expected = lambda k: expected_tokens(acceptance, k)  # noqa: E731
        cost = self.timer.cost()
        if cost is None:  # nothing measured yet: speculate as configured
            return offered
        shared = cost.fixed_s / max(self.timer.batch(), 1.0) + cost.per_request_s
        best, best_rate = 0, 0.0
        for k in range(offered + 1):
            seconds = shared + cost.per_token_s * (k + 1) + draft_s_per_token * k
            rate = expected(k) / seconds if seconds > 0 else float("inf")
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best


class DraftBudget:
    """One request's budget: `__call__(source, offered)` gives this round's cap, `observe` learns from
    the review.

    E(k) blends this request's rounds (decayed, DECAY per round) with every request's (PRIOR_WEIGHT
    rounds' worth): blocks are not geometric (a MaG lookup that copies the prompt is accepted whole or
    not at all), so measured means beat a per-token acceptance; the geometric model with a neutral
    acceptance fills in for k no round has offered yet. One round in EXPLORE (counted over all requests)
    that would draft less drafts all it is offered, so evidence on long blocks keeps coming while the load keeps the budget
    short.
    """

    DECAY = 0.9  # per round: the estimate follows the text as it changes (half-weight after ~7 rounds)
    PRIOR_WEIGHT = 2.0  # every request's evidence counts as this many of this request's rounds
    NEUTRAL = 0.5  # per-token acceptance assumed where nothing was measured
    EXPLORE = 16

    def __init__(self, model: LoadModel):
        self.model = model
        self.own = {s: Evidence(model.max_block, self.DECAY) for s in SOURCES}
        self.chosen: list[int] = []  # the cap of each round (what a benchmark reads)
        self._round: tuple[str, int] | None = None

    def expected(self, source: str, k: int) -> float:
        weight, mean = self.own[source].at(k)
        prior_weight, prior = self.model.population(source, k)
        if prior_weight > 0.0:
            prior_weight = self.PRIOR_WEIGHT
        else:
            prior, prior_weight = expected_tokens(self.NEUTRAL, k) - 1.0, 1.0
        return 1.0 + (weight * mean + prior_weight * prior) / (weight + prior_weight)

    def __call__(self, source: str, offered: int) -> int:
        """This round's cap for `offered` drafts from `source` ("lookup" or "model")."""
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        offered = max(0, min(offered, self.model.max_block))
        if self.model.warming_up(source):  # nothing to go on yet: speculate as configured
            self.chosen.append(offered)
            self._round = (source, offered)
            return offered
        draft_cost = 0.0 if source == "lookup" else self.model.draft_cost(source)
        k = self.model.best_block(lambda k: self.expected(source, k), offered, draft_cost)
        if k < offered and self.model.explore_now():
            k = offered
        self.chosen.append(k)
        self._round = (source, k)
        return k

    def observe(self, drafted: int, accepted: int, draft_s: float = 0.0) -> None:
        """The round's review: `drafted` tokens reached the target (fewer than the cap where a drafter
        stopped early), `accepted` of them kept; `draft_s` seconds were spent drafting them."""
        if self._round is None:
            return
        source, _ = self._round
        self._round = None
        self.own[source].add(drafted, accepted)
        self.model.observe(source, drafted, accepted, drafted, draft_s)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round yields with k drafts each accepted with probability `acceptance` until the first
    rejection, plus the target's own token: sum_{i=0..k} a^i."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


BudgetFactory = Callable[[], DraftBudget]
