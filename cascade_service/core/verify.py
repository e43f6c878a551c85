"""Final-verifier rules: exact review, or a lossy one chosen per request, with the loss accounted.

Only the target's review (the final verifier) may be lossy; inner reviews keep their own rules.
Every rule is "speculative sampling against a target distribution pi" (Narasimhan et al.,
Algorithm 4): keep draft x with probability min(1, pi(x) / q(x)), replace a rejected one from
norm(max(0, pi - q)). Rules differ in pi (the same paper, §4.1-4.4):

- exact     pi = p.
- lossy     pi = max(min(q, p / (1 - alpha)), p / beta): lossy speculative sampling (Tran-Thien;
            DistillSpec). beta = 1 (the common heuristic) or tuned per position so that pi sums to 1
            (the same paper, §2). alpha in [0, 1); alpha = 0 is exact.
- chow, diff, opt: pi = p where the rule defers, else q (speculative cascades, Eq. 2, 5, 10):
            chow defers when max q < 1 - alpha, diff when max q < max p - alpha, opt when
            max q <= max p - alpha * TV(p, q).
- token-v1, token-v2, token-v3: token-specific deferral (Eq. 11-15): tokens v with r(v) = 1 are
            unacceptable; pi(v) = q(v) (1 - r(v)) + p(v) * sum_u r(u) q(u). r(v) is
            q(v) < max p - alpha (v1), p(v) < max p - alpha (v2), p(v) < (1 - alpha) max p (v3).
  For all six, alpha in [-1, 1]; alpha = -1 defers everywhere, i.e. exact (for opt because
  max q - max p <= TV(p, q) always, hence "<=").
- fuzzy-js, fuzzy-kl, fuzzy-kl-rev, fuzzy-tv: fuzzy speculative decoding (Holsman et al., §3):
  keep x iff Div(p, q) < T, deterministically; at the first
  failing position sample from p itself. alpha carries T >= 0; T = 0 keeps nothing, i.e. exact.
  js is the textbook Jensen-Shannon divergence in nats (<= ln 2; the paper's code computes another,
  unbounded quantity, so its thresholds do not transfer), kl is KL(p || q), kl-rev KL(q || p), tv
  total variation.

Where the papers leave choices, ours:
- Rules read the distributions the review uses: temperature and top-p applied (greedy: softmax at
  temperature 1). The bonus token comes from p, since q at the bonus position is never computed.
- A point-mass proposal (MaG's, or a model at probability 1.0) carries no confidence; rules that read
  q's confidence (chow, diff, opt, token-v1) judge such a position exactly.
- Greedy forms (temperature 0), from one-hot q~ and p~ (ours; raw probabilities would make max q~ = 1 always): a draft x
  equal to argmax p is kept under every rule; otherwise it is kept iff the rule would not defer:
  chow q(x) >= 1 - alpha; diff q(x) >= max p - alpha; opt q(x) > max p - alpha (Lemma 9: opt = diff
  under greedy, up to ties); token-v1 q(x) >= max p - alpha; token-v2 p(x) >= max p - alpha;
  token-v3 p(x) >= (1 - alpha) max p (Leviathan et al.'s lossy greedy rule); fuzzy Div(p, q) < T
  on raw rows; lossy reduces to exact (pi~ is p's one-hot). A kept non-argmax token is a token
  from a distribution other than the target's; a rejected one is replaced by argmax p.

Accounting (the loss made visible): per emitted position, the distribution o the token was drawn
from is compared with p: `off_target` counts positions with o != p, `tv` sums TV(o, p), the
expected total-variation deviation, and `ll_loss` sums E_p[log p] - E_o[log p], the expected drop
in the target's log-likelihood (negative where o favours tokens the target likes more than its own
sample does). Greedy: o is the emitted token's one-hot and p's is its argmax's. These expectations
are exact per position, so they measure a rule's loss with far less noise than scoring samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .placement import uniform
from .quote import quoted
from .review import ReviewRule, Verdict, rule_for
from .rules import (  # noqa: F401 - the registry's names are part of this module's interface
    ALPHA_RANGE,
    CASCADE_RULES,
    FUZZY_RULES,
    REGISTRY,
    RULES,
    STRICT_ALPHA,
    TINY,
    Lossy,
    Rule,
    divergence,
    tuned_beta,
    tv,
)
from .sampling import residual, sample
from .types import Draft


@dataclass(frozen=True)
class Verification:
    """The final verifier's rule for one request. `alpha` is the rule's knob (None: its strict end,
    i.e. exact output); `beta` is lossy's residual scale (>= 1 - alpha; None: tuned per position).
    `family` is the rule itself, picked from the registry once, when the request is built."""

    rule: str = "exact"
    alpha: float | None = None
    beta: float | None = 1.0
    family: Rule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        family = REGISTRY.get(self.rule) if isinstance(self.rule, str) else None
        if family is None:
            raise ValueError(f"verification.rule must be one of {', '.join(RULES)}; got {quoted(self.rule)}")
        object.__setattr__(self, "family", family)
        alpha = self.knob
        low, high = family.low, family.high
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or math.isnan(alpha):
            raise ValueError(f"verification.alpha must be a number, got {quoted(self.alpha)}")
        upper_ok = alpha < high if family.open_high else alpha <= high
        if not (low <= alpha and upper_ok):
            bracket = ")" if family.open_high else "]"
            raise ValueError(
                f"verification.alpha for rule {quoted(self.rule)} must be in [{low:g}, {high:g}{bracket}, "
                f"got {quoted(alpha)}"
            )
        if isinstance(family, Lossy) and self.beta is not None:
            if (
                isinstance(self.beta, bool)
                or not isinstance(self.beta, (int, float))
                or not (self.beta >= 1.0 - alpha and math.isfinite(self.beta))
            ):
                raise ValueError(
                    f"verification.beta must be a finite number >= 1 - alpha = {1.0 - alpha:g}, got {quoted(self.beta)}"
                )

    @property
    def knob(self) -> float:
        return REGISTRY[self.rule].strict if self.alpha is None else self.alpha

    @property
    def exact(self) -> bool:
        """True when this request's output is exactly the target's (the rule is at its strict end;
        lossy's also needs beta 1 or tuned, since a larger beta shrinks the residual)."""
        if isinstance(self.family, Lossy) and self.beta not in (None, 1.0):
            return False
        return self.knob == self.family.strict

    @property
    def needs_rows(self) -> bool:
        """Fuzzy rules compare whole distributions, so greedy drafts must carry their rows."""
        return self.family.needs_rows

    def describe(self) -> str:
        if self.rule == "exact":
            return "exact"
        beta = "" if self.rule != "lossy" else (", beta tuned" if self.beta is None else f", beta {self.beta:g}")
        return f"{self.rule} (alpha {self.knob:g}{beta})"


EXACT = Verification()


def target_distribution(v: Verification, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """pi for one position, [V], from the proposal and the target's distribution (not for fuzzy rules)."""
    return v.family.pi(draft_probs, target_probs, v.knob, v.beta)


def output_distribution(pi: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """What speculative sampling against pi with proposal q (`draft_probs`) actually emits at a
    position: min(q, pi) + (1 - sum min(q, pi)) * norm(max(0, pi - q)); equal to pi when pi sums to 1."""
    kept = torch.minimum(draft_probs, pi)
    return kept + (1.0 - kept.sum()).clamp_min(0.0) * residual(pi, draft_probs)


class VerifyReview:
    """The final verifier's ReviewRule for a lossy `Verification` (exact uses core.review's rules)."""

    draws = True  # a lossy rule may draw even for a greedy request

    def __init__(self, verification: Verification, greedy: bool):
        self.v = verification
        self.greedy = greedy

    def review(self, block: Draft, target_probs: torch.Tensor, leniency: float, generator: torch.Generator) -> Verdict:
        if self.greedy:
            return self._greedy(block, target_probs)
        return self._sampling(block, target_probs, generator)

    def _greedy(self, block: Draft, target_probs: torch.Tensor) -> Verdict:
        k, v, alpha = len(block), self.v, self.v.knob
        best = target_probs.argmax(dim=-1).tolist()
        target_max = target_probs.max(dim=-1).values.tolist()
        accepted = off = 0
        loss = 0.0
        for i in range(k):
            x = block.tokens[i]
            if x != best[i]:
                if not self._keep_greedy(
                    v,
                    alpha,
                    x,
                    float(block.token_probs[i]),
                    target_probs[i],
                    target_max[i],
                    None if block.dists is None else block.dists[i],
                ):
                    break
                off += 1
                loss += math.log(target_max[i]) - math.log(max(float(target_probs[i, x]), TINY))
            accepted += 1
        token = best[accepted]
        probs = [float(target_probs[i, block.tokens[i]]) for i in range(accepted)]
        probs.append(float(target_probs[accepted, token]))
        return Verdict(accepted, token, probs, None, off_target=off, tv=float(off), ll_loss=loss)

    @staticmethod
    def _keep_greedy(
        v: Verification,
        alpha: float,
        x: int,
        draft_prob: float,
        target_probs: torch.Tensor,
        target_max: float,
        draft_row: torch.Tensor | None,
    ) -> bool:
        rule = v.family
        if rule.fuzzy:
            if draft_row is None:
                raise ValueError("fuzzy rules need the drafts' distributions (Verification.needs_rows)")
            return rule.keep(target_probs, draft_row, alpha)
        if rule.reads_confidence and draft_prob >= 1.0:
            return False  # a point mass carries no confidence
        return rule.keep_greedy(draft_prob, float(target_probs[x]), target_max, alpha)

    def _sampling(self, block: Draft, target_probs: torch.Tensor, generator: torch.Generator) -> Verdict:
        k, v = len(block), self.v
        assert block.dists is not None or k == 0, "sampling review needs the drafts' distributions"
        drafts = block.dists if block.dists is not None else target_probs[:0]  # [k, V]
        fuzzy = v.family.fuzzy
        accepted, token, off, deviation, loss = k, None, 0, 0.0, 0.0
        for i in range(k):
            draft_row, target_row, x = drafts[i], target_probs[i], block.tokens[i]
            if fuzzy:
                keep = v.family.keep(target_row, draft_row, v.knob)
                out = draft_row if keep else target_row
                replacement = None if keep else target_row
            else:
                pi = target_distribution(v, draft_row, target_row)
                ratio = float(pi[x]) / max(float(draft_row[x]), TINY)
                keep = float(uniform((), target_probs, generator)) < min(1.0, ratio)
                out = output_distribution(pi, draft_row)
                replacement = None if keep else residual(pi, draft_row)
            gap = float(tv(out, target_row))
            if gap > 1e-6:
                off += 1
                deviation += gap
                loss += float(((target_row - out) * target_row.clamp_min(TINY).log()).sum())
            if not keep:
                assert replacement is not None
                accepted, token = i, sample(replacement, generator)
                break
        if token is None:
            token = sample(target_probs[k], generator)  # the bonus comes from p (q at k is never computed)
        tokens = block.tokens[:accepted] + [token]
        probs = [float(target_probs[i, t]) for i, t in enumerate(tokens)]
        return Verdict(accepted, token, probs, None, off_target=off, tv=deviation, ll_loss=loss)


def final_rule(greedy: bool, verification: Verification | None) -> ReviewRule:
    """The target's ReviewRule: core.review's exact rules unless this request asked for a lossy one."""
    if verification is None or verification.rule == "exact":
        return rule_for(greedy)
    return VerifyReview(verification, greedy)
