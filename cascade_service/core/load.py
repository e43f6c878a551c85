"""Speculation that adapts to load (issue 7): each round's draft budget at the target, per request.

Speculation buys tokens per target pass with extra verified positions. That pays while a pass costs
mostly its fixed part (reading the weights, launching kernels, Python) and stops paying once the batch
is large enough that a pass costs mostly per token (compute-bound): then every rejected draft is
wasted work that other requests wait for. CS Drafting's EWIF (paper §3.2) makes the trade explicit;
here its terms are measured instead of assumed:

    E(k)    = (1 - a^(k+1)) / (1 - a)             tokens a round yields with k drafts, acceptance a
    cost(k) = F/B + c (k + 1) + r k (F/B + c)     this request's share of target time for the round,
                                                  plus drafting (r: drafter / target cost per token)

where a pass over T tokens takes F + c T seconds (fitted from the target's recent batched passes) and B
is the current batch size at the target. The budget is the k in [0, max] that maximizes E(k) / cost(k);
k = 0 is plain decoding for that round. Acceptance is measured per request (accepted drafts over
accepted drafts plus rejections, the geometric model's estimate, over recent rounds) starting from a
neutral prior, so a request whose drafts keep failing drafts less even when the machine is idle.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class PassCost:
    """A forward pass over T tokens takes fixed_s + per_token_s * T."""

    fixed_s: float
    per_token_s: float


class PassTimer:
    """Recent (tokens, seconds) of one model's passes, fitted to a PassCost by least squares.

    `batch` is the mean number of requests per pass over the same window. Thread-safe.
    """

    def __init__(self, window: int = 256, min_passes: int = 16):
        self._passes: deque[tuple[int, int, float]] = deque(maxlen=window)  # (requests, tokens, seconds)
        self._lock = threading.Lock()
        self.min_passes = min_passes

    def record(self, requests: int, tokens: int, seconds: float) -> None:
        with self._lock:
            self._passes.append((requests, tokens, seconds))

    def batch(self) -> float:
        with self._lock:
            passes = list(self._passes)
        return sum(r for r, _, _ in passes) / len(passes) if passes else 1.0

    def cost(self) -> PassCost | None:
        """The fitted cost, or None before enough passes of at least two sizes were seen."""
        with self._lock:
            passes = list(self._passes)
        if len(passes) < self.min_passes:
            return None
        xs = [t for _, t, _ in passes]
        ys = [s for _, _, s in passes]
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:
            return None
        slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx, 0.0)
        return PassCost(max(my - slope * mx, 0.0), slope)


class LoadModel:
    """What every request's budget consults: the target's pass cost and batch size, the drafting cost.

    draft_ratio: the cost of drafting one token relative to one target token (e.g. the largest model
    drafter's parameter ratio; MaG alone costs ~0).
    """

    def __init__(self, timer: PassTimer, draft_ratio: float):
        if not draft_ratio >= 0:
            raise ValueError(f"draft_ratio must be >= 0, got {draft_ratio}")
        self.timer = timer
        self.draft_ratio = draft_ratio

    def budget(self, max_block: int) -> "DraftBudget":
        return DraftBudget(self, max_block)

    def best_block(self, acceptance: float, max_block: int) -> int:
        cost = self.timer.cost()
        if cost is None:  # nothing measured yet: speculate as configured
            return max_block
        shared = cost.fixed_s / max(self.timer.batch(), 1.0)
        best, best_rate = 0, 0.0
        for k in range(max_block + 1):
            tokens = expected_tokens(acceptance, k)
            seconds = shared + cost.per_token_s * (k + 1) + self.draft_ratio * k * (shared + cost.per_token_s)
            rate = tokens / seconds if seconds > 0 else float("inf")
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best


class DraftBudget:
    """One request's budget: `__call__` gives this round's cap, `observe` learns from the review."""

    PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0  # acceptance 0.5 before any evidence
    DECAY = 0.9  # per round: the estimate follows the text as it changes (half-weight after ~7 rounds)

    def __init__(self, model: LoadModel, max_block: int):
        self.model = model
        self.max_block = max_block
        self.accepted = 0.0
        self.rejections = 0.0
        self.chosen: list[int] = []  # the cap of each round (what a benchmark reads)

    @property
    def acceptance(self) -> float:
        accepted = self.accepted + self.PRIOR_ACCEPTED
        return accepted / (accepted + self.rejections + self.PRIOR_REJECTED)

    def __call__(self) -> int:
        k = self.model.best_block(self.acceptance, self.max_block)
        self.chosen.append(k)
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = self.DECAY * self.accepted + accepted
        self.rejections = self.DECAY * self.rejections + int(accepted < drafted)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round yields with k drafts each accepted with probability `acceptance` until the first
    rejection, plus the target's own token: sum_{i=0..k} a^i."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


BudgetFactory = Callable[[int], DraftBudget]
