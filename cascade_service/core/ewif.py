"""Expected walltime improvement factor (CS Drafting §4.1), used to choose draft lengths.

Theorem 4.1: with acceptance alpha_i of the token at block position i and cost c_i (relative to one
target call) of the drafter that proposes it,
    EWIF = (sum_{i=0..k} prod_{j<=i} alpha_j) / (1 + sum_{i=1..k} c_i)
(the empty product for i = 0 is the token the target always emits). Corollary 4.2, one drafter:
    EWIF = (1 - alpha^(k+1)) / ((1 - alpha) (c k + 1)).
"""

from __future__ import annotations

from collections.abc import Sequence


def ewif(alphas: Sequence[float], costs: Sequence[float]) -> float:
    """Theorem 4.1 for one block: alphas[i], costs[i] describe block position i + 1."""
    if len(alphas) != len(costs):
        raise ValueError("alphas and costs must have one entry per block position")
    expected, survive = 1.0, 1.0
    for alpha in alphas:
        survive *= alpha
        expected += survive
    return expected / (1.0 + sum(costs))


def ewif_single(alpha: float, cost: float, k: int) -> float:
    """Corollary 4.2: one drafter proposing k tokens per target call."""
    return ewif([alpha] * k, [cost] * k)


def best_k(alpha: float, cost: float, k_max: int = 16) -> int:
    """The draft length that maximises Corollary 4.2 (ties: the shorter block)."""
    return max(range(1, k_max + 1), key=lambda k: (ewif_single(alpha, cost, k), -k))
