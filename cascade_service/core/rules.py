"""The final verifier's rules, each a class behind one interface (`Rule`), all in one registry.

`core.verify` picks a request's rule from `REGISTRY` once (`Verification.family`); the CLI's help,
the docs and the API contract are checked against the same registry (tests/unit/test_rule_registry.py).
The formulas are documented in `core.verify` and docs/lossy.md.
"""

from __future__ import annotations

import math

import torch

from .quote import quoted

TINY = 1e-30


class Rule:
    """One final-verifier rule, behind the interface every rule shares. `target_probs` is the target's
    distribution at a position (the papers' p), `draft_probs` the proposal's (q).

    Sampling form: `pi(draft_probs, target_probs, alpha, beta)`, the distribution speculative sampling
    judges against (fuzzy rules decide by `keep` instead). Greedy form: `keep_greedy`, whether a draft
    that is not the target's argmax is kept.
    """

    name = ""
    summary = ""
    low, high, open_high = 0.0, 0.0, False  # the knob's range; open_high: the upper end is excluded
    strict = 0.0  # the knob's value at which the rule is exact
    reads_confidence = False  # reads q's confidence: a point-mass proposal is judged exactly
    needs_rows = False  # compares whole distributions: greedy drafts must carry their rows
    fuzzy = False  # decides by a divergence threshold, not by speculative sampling

    def pi(
        self, draft_probs: torch.Tensor, target_probs: torch.Tensor, alpha: float, beta: float | None
    ) -> torch.Tensor:
        return target_probs

    def keep_greedy(self, draft_prob: float, target_prob: float, target_max: float, alpha: float) -> bool:
        return False

    def keep(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, alpha: float) -> bool:
        raise TypeError(f"{self.name} is not a fuzzy rule")


class Exact(Rule):
    name, summary = "exact", "pi = p: the target's own output (the default)"


class Lossy(Rule):
    name = "lossy"
    summary = "pi = max(min(q, p / (1 - alpha)), p / beta): lossy speculative sampling"
    low, high, open_high = 0.0, 1.0, True

    def pi(self, draft_probs, target_probs, alpha, beta):  # type: ignore[no-untyped-def]
        beta = tuned_beta(draft_probs, target_probs, alpha) if beta is None else beta
        return torch.maximum(torch.minimum(draft_probs, target_probs / (1.0 - alpha)), target_probs / beta)


class Deferral(Rule):
    """Speculative cascades' deferral rules (Eq. 2, 5, 10): pi = p where the rule defers, else q."""

    low, high, strict = -1.0, 1.0, -1.0
    reads_confidence = True

    def defers(
        self, draft_max: float, target_max: float, alpha: float, draft_probs: torch.Tensor, target_probs: torch.Tensor
    ) -> bool:
        raise NotImplementedError

    def pi(self, draft_probs, target_probs, alpha, beta):  # type: ignore[no-untyped-def]
        if float(draft_probs.max()) >= 1.0:
            return target_probs  # no confidence information in a point mass: judge it exactly
        defer = self.defers(float(draft_probs.max()), float(target_probs.max()), alpha, draft_probs, target_probs)
        return target_probs if defer else draft_probs


class Chow(Deferral):
    name, summary = "chow", "defer when max q < 1 - alpha"

    def defers(self, draft_max, target_max, alpha, draft_probs, target_probs):  # type: ignore[no-untyped-def]
        return draft_max < 1.0 - alpha

    def keep_greedy(self, draft_prob, target_prob, target_max, alpha):  # type: ignore[no-untyped-def]
        return draft_prob >= 1.0 - alpha


class Diff(Deferral):
    name, summary = "diff", "defer when max q < max p - alpha"

    def defers(self, draft_max, target_max, alpha, draft_probs, target_probs):  # type: ignore[no-untyped-def]
        return draft_max < target_max - alpha

    def keep_greedy(self, draft_prob, target_prob, target_max, alpha):  # type: ignore[no-untyped-def]
        return draft_prob >= target_max - alpha


class Opt(Deferral):
    name, summary = "opt", "defer when max q <= max p - alpha * TV(p, q)"

    def defers(self, draft_max, target_max, alpha, draft_probs, target_probs):  # type: ignore[no-untyped-def]
        return draft_max <= target_max - alpha * float(tv(target_probs, draft_probs))

    def keep_greedy(self, draft_prob, target_prob, target_max, alpha):  # type: ignore[no-untyped-def]
        return draft_prob > target_max - alpha  # defers on <=, see the module docstring


class TokenSpecific(Rule):
    """Token-specific deferral (Eq. 11-15): tokens v with r(v) = 1 are unacceptable;
    pi(v) = q(v) (1 - r(v)) + p(v) * sum_u r(u) q(u)."""

    low, high, strict = -1.0, 1.0, -1.0

    def unacceptable(
        self, draft_probs: torch.Tensor, target_probs: torch.Tensor, target_max: float, alpha: float
    ) -> torch.Tensor:
        raise NotImplementedError

    def pi(self, draft_probs, target_probs, alpha, beta):  # type: ignore[no-untyped-def]
        if self.reads_confidence and float(draft_probs.max()) >= 1.0:
            return target_probs  # no confidence information in a point mass: judge it exactly
        unacceptable = self.unacceptable(draft_probs, target_probs, float(target_probs.max()), alpha)
        eta = float((draft_probs * unacceptable).sum())
        return torch.where(unacceptable, torch.zeros_like(draft_probs), draft_probs) + eta * target_probs


class TokenV1(TokenSpecific):
    name, summary = "token-v1", "r(v) = q(v) < max p - alpha"
    reads_confidence = True

    def unacceptable(self, draft_probs, target_probs, target_max, alpha):  # type: ignore[no-untyped-def]
        return draft_probs < target_max - alpha

    def keep_greedy(self, draft_prob, target_prob, target_max, alpha):  # type: ignore[no-untyped-def]
        return draft_prob >= target_max - alpha


class TokenV2(TokenSpecific):
    name, summary = "token-v2", "r(v) = p(v) < max p - alpha"

    def unacceptable(self, draft_probs, target_probs, target_max, alpha):  # type: ignore[no-untyped-def]
        return target_probs < target_max - alpha

    def keep_greedy(self, draft_prob, target_prob, target_max, alpha):  # type: ignore[no-untyped-def]
        return target_prob >= target_max - alpha


class TokenV3(TokenSpecific):
    name, summary = "token-v3", "r(v) = p(v) < (1 - alpha) max p"

    def unacceptable(self, draft_probs, target_probs, target_max, alpha):  # type: ignore[no-untyped-def]
        return target_probs < (1.0 - alpha) * target_max

    def keep_greedy(self, draft_prob, target_prob, target_max, alpha):  # type: ignore[no-untyped-def]
        return target_prob >= (1.0 - alpha) * target_max


class Fuzzy(Rule):
    """Fuzzy speculative decoding: keep x iff Div(p, q) < T (alpha carries T), deterministically."""

    low, high = 0.0, math.inf
    needs_rows = True
    fuzzy = True

    def __init__(self, kind: str, summary: str):
        self.kind = kind
        self.name = f"fuzzy-{kind}"
        self.summary = summary

    def keep(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, alpha: float) -> bool:
        return float(divergence(self.kind, target_probs, draft_probs)) < alpha


REGISTRY: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Exact(),
        Lossy(),
        Chow(),
        Diff(),
        Opt(),
        TokenV1(),
        TokenV2(),
        TokenV3(),
        Fuzzy("js", "keep iff JS(p, q) < alpha (nats)"),
        Fuzzy("kl", "keep iff KL(p || q) < alpha"),
        Fuzzy("kl-rev", "keep iff KL(q || p) < alpha"),
        Fuzzy("tv", "keep iff TV(p, q) < alpha"),
    )
}
"""Every final-verifier rule by name: the one place the CLI, the API, the docs and the verifier pick from."""

RULES = tuple(REGISTRY)
CASCADE_RULES = tuple(n for n, r in REGISTRY.items() if isinstance(r, (Deferral, TokenSpecific)))
FUZZY_RULES = tuple(n for n, r in REGISTRY.items() if r.fuzzy)
ALPHA_RANGE = {n: (r.low, r.high) for n, r in REGISTRY.items()}
STRICT_ALPHA = {n: r.strict for n, r in REGISTRY.items()}


def divergence(kind: str, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Div(p, q) of the target's p and the draft's q over the last axis for fuzzy acceptance: "js"
    (nats), "kl" KL(p||q), "kl-rev" KL(q||p), "tv". Zero-probability entries contribute 0 (0 log 0 =
    0); KL to a distribution that misses p's support is +inf, which a threshold rejects."""
    if kind == "tv":
        return 0.5 * (target_probs - draft_probs).abs().sum(-1)
    if kind == "kl":
        return _kl(target_probs, draft_probs)
    if kind == "kl-rev":
        return _kl(draft_probs, target_probs)
    if kind == "js":
        middle = 0.5 * (target_probs + draft_probs)
        return 0.5 * _kl(target_probs, middle) + 0.5 * _kl(draft_probs, middle)
    raise ValueError(f"unknown divergence {quoted(kind)}")


def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        terms = torch.where(a > 0, a * (a.clamp_min(TINY).log() - b.clamp_min(0).log()), torch.zeros_like(a))
    return terms.sum(-1)


def tv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Total variation, sum(max(0, a - b)) over the last axis (= half the L1 distance)."""
    return (a - b).clamp_min(0).sum(-1)


def tuned_beta(draft_probs: torch.Tensor, target_probs: torch.Tensor, alpha: float, iterations: int = 60) -> float:
    """beta >= 1 - alpha with sum max(0, q - p/(1-alpha)) = sum max(0, p/beta - q) (Narasimhan et al. §2; q the
    draft's, p the target's), which makes lossy's pi a distribution. The right side falls from >= the
    left side at beta = 1 - alpha to 0 as beta grows, so bisection on log beta finds it."""
    p, q = target_probs, draft_probs  # the paper's letters, in the formulas below
    scale = 1.0 - alpha
    rejected = float((q - p / scale).clamp_min(0).sum())
    if rejected <= 0.0:
        return 1.0 if scale <= 1.0 else scale  # nothing to refill: any beta in range gives the same output
    low, high = math.log(scale), math.log(scale) + 1.0
    while float((p / math.exp(high) - q).clamp_min(0).sum()) > rejected and high < 200.0:
        high += 2.0 * (high - low)
    for _ in range(iterations):
        mid = 0.5 * (low + high)
        if float((p / math.exp(mid) - q).clamp_min(0).sum()) > rejected:
            low = mid
        else:
            high = mid
    return math.exp(0.5 * (low + high))
