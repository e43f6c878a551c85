"""Speculation that adapts to load (issue 7): each round's draft budget at the target, per request.

Speculation buys tokens per target pass with extra verified positions. That pays while a pass costs
mostly its fixed part (reading the weights, launching kernels, Python) and stops paying once the batch
is large enough that a pass costs mostly per token (compute-bound): then every rejected draft is
wasted work that other requests wait for. CS Drafting's EWIF (paper §3.2) makes the trade explicit;
here its terms are measured instead of assumed:

    E(k)    = tokens a round yields with at most k drafts (measured; geometric (1 - a^(k+1)) / (1 - a)
              with per-token acceptance a where not yet measured)
    cost(k) = S + c (k + 1) + d k (S + c),  S = F/B + q
              this request's share of target time for the round, plus drafting (d: drafter / target
              cost per token)

where a pass over B requests and T tokens takes F + q B + c T seconds (fitted from the target's recent
batched passes) and B is the current batch size at the target. Only F is shared by batching: on a CPU
the per-request part q (each row's cache and bookkeeping) is large, and then speculation keeps paying
under load. The budget is the k in [0, max] that maximizes E(k) / cost(k);
k = 0 is plain decoding for that round. E(k) is measured per request from its recent rounds (see
DraftBudget), so a request whose drafts keep failing drafts less even when the machine is idle.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch


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
        """The fitted cost, or None before enough passes of at least two token counts were seen.

        Without passes of different batch sizes the per-request term cannot be told from the fixed
        one; it is then 0 (all of it counted as fixed).
        """
        with self._lock:
            passes = list(self._passes)
        if len(passes) < self.min_passes or len({t for _, t, _ in passes}) < 2:
            return None
        rows_vary = len({r for r, _, _ in passes}) > 1
        x = torch.tensor([[1.0, float(r), float(t)] if rows_vary else [1.0, float(t)] for r, t, _ in passes],
                         dtype=torch.float64)
        y = torch.tensor([[s] for _, _, s in passes], dtype=torch.float64)
        coef = [max(float(c), 0.0) for c in torch.linalg.lstsq(x, y).solution.flatten()]
        return PassCost(coef[0], coef[1], coef[2]) if rows_vary else PassCost(coef[0], 0.0, coef[1])


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

    def best_block(self, expected: Callable[[int], float] | float, max_block: int) -> int:
        """The k in [0, max_block] with the most tokens per second; `expected(k)` is the tokens a round
        with at most k drafts yields (a float: per-token acceptance, the geometric model)."""
        if not callable(expected):
            acceptance = expected
            expected = lambda k: expected_tokens(acceptance, k)  # noqa: E731
        cost = self.timer.cost()
        if cost is None:  # nothing measured yet: speculate as configured
            return max_block
        shared = cost.fixed_s / max(self.timer.batch(), 1.0) + cost.per_request_s
        best, best_rate = 0, 0.0
        for k in range(max_block + 1):
            seconds = shared + cost.per_token_s * (k + 1) + self.draft_ratio * k * (shared + cost.per_token_s)
            rate = expected(k) / seconds if seconds > 0 else float("inf")
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best


class DraftBudget:
    """One request's budget: `__call__` gives this round's cap, `observe` learns from the review.

    E(k) is measured where it can be: over the request's recent rounds whose cap was at least k, the
    mean of min(accepted, k) + 1 (a block capped at k is the first k drafts of a longer one). Blocks
    are not geometric (a MaG lookup that copies the prompt is accepted whole or not at all), so this
    beats a per-token acceptance; the latter (decayed counts, a neutral prior) fills in for k no round
    has reached yet. Every EXPLORE-th round that would draft less drafts the full block, so evidence
    on long blocks keeps coming even while the load keeps the budget short.
    """

    PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0  # acceptance 0.5 before any evidence
    DECAY = 0.9  # per round: the estimate follows the text as it changes (half-weight after ~7 rounds)
    WINDOW = 32  # rounds kept for the measured E(k)
    MIN_ROUNDS = 3  # fewer rounds with cap >= k: use the per-token model for that k
    EXPLORE = 16

    def __init__(self, model: LoadModel, max_block: int):
        self.model = model
        self.max_block = max_block
        self.accepted = 0.0
        self.rejections = 0.0
        self.rounds: deque[tuple[int, int]] = deque(maxlen=self.WINDOW)  # (cap, accepted)
        self.chosen: list[int] = []  # the cap of each round (what a benchmark reads)

    @property
    def acceptance(self) -> float:
        accepted = self.accepted + self.PRIOR_ACCEPTED
        return accepted / (accepted + self.rejections + self.PRIOR_REJECTED)

    def expected(self, k: int) -> float:
        seen = [min(accepted, k) for cap, accepted in self.rounds if cap >= k]
        if len(seen) >= self.MIN_ROUNDS:
            return 1.0 + sum(seen) / len(seen)
        return expected_tokens(self.acceptance, k)

    def __call__(self) -> int:
        k = self.model.best_block(self.expected, self.max_block)
        if k < self.max_block and len(self.chosen) % self.EXPLORE == self.EXPLORE - 1:
            k = self.max_block
        self.chosen.append(k)
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        cap = self.chosen[-1] if self.chosen else drafted
        self.rounds.append((cap, accepted))
        self.accepted = self.DECAY * self.accepted + accepted
        self.rejections = self.DECAY * self.rejections + int(accepted < drafted)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round yields with k drafts each accepted with probability `acceptance` until the first
    rejection, plus the target's own token: sum_{i=0..k} a^i."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


BudgetFactory = Callable[[int], DraftBudget]
