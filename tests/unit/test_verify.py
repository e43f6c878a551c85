"""Final-verifier rules (core/verify.py) against independent references written from the papers.

- One position: the emitted token's distribution equals the paper's pi (speculative cascades,
  Algorithm 4), or for lossy with beta = 1 the mixture Algorithm 4 actually produces.
- Strict end: every rule at its strict knob leaves the whole cascade's output distributed exactly as
  the target's (toy models, chi-square), and a lossy setting is detected as not exact.
- Greedy forms as documented: token-v3 is Leviathan et al.'s lossy greedy rule, opt equals diff.
- Acceptance grows with alpha; tuned beta makes pi a distribution; bad knobs name their field.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from cascade_service.core.cascade import Lookup, RequestState, build_cascade
from cascade_service.core.decode import decode
from cascade_service.core.local import local_tiers
from cascade_service.core.proposers.mag import BigramTable, MaxGram
from cascade_service.core.sampling import SamplingParams
from cascade_service.core.schedule import Schedule
from cascade_service.core.stats import CascadeStats
from cascade_service.core.types import Draft
from cascade_service.core.verify import (
    FUZZY_RULES,
    RULES,
    STRICT_ALPHA,
    Verification,
    VerifyReview,
    divergence,
    target_distribution,
    tuned_beta,
)

from ..helpers.toy import ToyScorer, chi_square_rejects, exact_distribution

V = 5


def _dist(seed: int, peak: float = 2.0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g) * peak, dim=0).tolist()


# --- independent references (plain Python, from the papers' formulas) ------------------------------


def ref_pi(rule: str, a: float, q: list[float], p: list[float], beta: float = 1.0) -> list[float]:
    qm, pm = max(q), max(p)
    if rule == "lossy":
        return [max(min(qv, pv / (1 - a)), pv / beta) for qv, pv in zip(q, p)]
    if rule in ("chow", "diff", "opt", "token-v1") and qm >= 1.0:
        return list(p)
    total_variation = sum(max(0.0, pv - qv) for qv, pv in zip(q, p))
    if rule in ("chow", "diff", "opt"):
        defer = {"chow": qm < 1 - a, "diff": qm < pm - a, "opt": qm <= pm - a * total_variation}[rule]
        return list(p) if defer else list(q)
    r = {
        "token-v1": [qv < pm - a for qv in q],
        "token-v2": [pv < pm - a for pv in p],
        "token-v3": [pv < (1 - a) * pm for pv in p],
    }[rule]
    eta = sum(qv for qv, rv in zip(q, r) if rv)
    return [qv * (not rv) + pv * eta for qv, pv, rv in zip(q, p, r)]


def ref_output(pi: list[float], q: list[float]) -> list[float]:
    kept = [min(a, b) for a, b in zip(q, pi)]
    gap = [max(0.0, b - a) for a, b in zip(q, pi)]
    rest = 1.0 - sum(kept)
    return [k + (rest * g / sum(gap) if sum(gap) > 0 else 0.0) for k, g in zip(kept, gap)]


def _first_tokens(v: Verification, q: list[float], p: list[float], n: int, seed: int = 0) -> Counter:
    """The emitted token at a position whose draft x ~ q, reviewed n times."""
    review = VerifyReview(v, greedy=False)
    g = torch.Generator().manual_seed(seed)
    q_t, p_t = torch.tensor([q]), torch.tensor([p, p])  # [1, V]; [2, V] (block + bonus row)
    xs = torch.multinomial(q_t[0], n, replacement=True, generator=g).tolist()
    counts: Counter = Counter()
    for x in xs:
        verdict = review.review(Draft([x], [q[x]], q_t, ["d"]), p_t, 1.0, g)
        counts[(x if verdict.accepted else verdict.token,)] += 1
    return counts


CASES = [(rule, a) for rule in ("chow", "diff", "opt") for a in (0.05, 0.3)] + [
    (rule, a) for rule in ("token-v1", "token-v2", "token-v3") for a in (0.1, 0.5)
]


@pytest.mark.parametrize("rule,alpha", CASES)
def test_emitted_token_follows_the_papers_pi(rule, alpha):
    n = 6000
    for seed in (1, 2):
        q, p = _dist(10 * seed, 1.0), _dist(10 * seed + 1, 2.5)
        pi = ref_pi(rule, alpha, q, p)
        assert math.isclose(sum(pi), 1.0, abs_tol=1e-6)  # cascade targets are distributions
        ours = target_distribution(Verification(rule, alpha), torch.tensor(q), torch.tensor(p)).tolist()
        assert ours == pytest.approx(pi, abs=1e-6)
        counts = _first_tokens(Verification(rule, alpha), q, p, n, seed)
        rejects, stat, crit = chi_square_rejects(counts, {(v,): pi[v] for v in range(V)}, n)
        assert not rejects, f"{rule} {alpha}: chi-square {stat:.1f} > {crit:.1f}"


@pytest.mark.parametrize("beta", [1.0, 1.3, None], ids=["beta1", "beta1.3", "tuned"])
def test_lossy_speculative_sampling_emits_algorithm_4s_mixture(beta):
    n, alpha = 6000, 0.3
    q, p = _dist(3, 1.5), _dist(4, 2.0)
    b = tuned_beta(torch.tensor(q), torch.tensor(p), alpha) if beta is None else beta
    pi = ref_pi("lossy", alpha, q, p, b)
    expected = ref_output(pi, q)
    if beta is None:  # tuned beta makes pi a distribution, so the output is pi itself (Narasimhan et al. §4.1)
        assert b >= 1 - alpha and math.isclose(sum(pi), 1.0, abs_tol=1e-6)
        assert expected == pytest.approx(pi, abs=1e-6)
    counts = _first_tokens(Verification("lossy", alpha, beta), q, p, n, seed=1)
    rejects, stat, crit = chi_square_rejects(counts, {(v,): expected[v] for v in range(V)}, n)
    assert not rejects, f"chi-square {stat:.1f} > {crit:.1f}"


def test_lossy_acceptance_is_min_1_p_over_1_minus_alpha_q():
    # Lemma 3: pi's acceptance equals lossy SD's kappa = min(1, p / ((1 - alpha) q)) token by token.
    q, p = torch.tensor(_dist(5, 1.0)), torch.tensor(_dist(6, 3.0))
    for alpha in (0.1, 0.4, 0.8):
        for beta in (1.0, tuned_beta(q, p, alpha)):
            pi = target_distribution(Verification("lossy", alpha, beta), q, p)
            kappa = torch.clamp(p / ((1 - alpha) * q), max=1.0)
            assert torch.allclose(torch.clamp(pi / q, max=1.0), kappa, atol=1e-6)


# --- the strict end is exact; a lossy knob is not ----------------------------------------------------

SAMPLES, LENGTH, PROMPT = 2500, 3, [0, 1, 2, 0, 1]


def _sample(v: Verification, samples: int = SAMPLES):
    target = ToyScorer("target", 4, seed=1)
    base = ToyScorer("base", 4, seed=2, base=target, noise=1.5)
    bigram = BigramTable.from_tokens([0, 1, 2, 3, 0, 2, 1, 3, 3, 1], 4)
    sampling = SamplingParams(1.0, rows=v.needs_rows)
    counts: Counter = Counter()
    for i in range(samples):
        state = RequestState(sampling, torch.Generator().manual_seed(i), CascadeStats("target"), 4, verification=v)
        # MaG drafts straight to the target through the gate (point masses) and through base's review
        system = build_cascade(
            *local_tiers(4, target, [base, MaxGram(bigram)]),
            Schedule.parse([[2, 1], [0, 2]], ["base", "mag"]),
            2.0,
            state,
            Lookup(1, 2),
        )
        counts[tuple(t for chunk in decode(system, PROMPT, LENGTH, state) for t in chunk)] += 1
    return counts, exact_distribution(target, PROMPT, LENGTH, sampling)


@pytest.mark.parametrize("rule", [r for r in RULES if r != "exact"])
def test_every_rule_at_its_strict_end_samples_exactly_the_target(rule):
    counts, expected = _sample(Verification(rule, STRICT_ALPHA[rule]))
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert not rejects, f"{rule} at its strict end: chi-square {stat:.1f} > {crit:.1f}"


@pytest.mark.parametrize("rule,alpha", [("token-v3", 0.8), ("chow", 0.9), ("fuzzy-tv", 0.6)])
def test_a_lossy_knob_is_detected_as_not_exact(rule, alpha):
    counts, expected = _sample(Verification(rule, alpha))
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES)
    assert rejects, f"{rule} {alpha} passed as exact (chi-square {stat:.1f} <= {crit:.1f})"


# --- greedy forms ------------------------------------------------------------------------------------


def _greedy_block(seed: int, k: int = 6):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, dim=-1)
    tokens = q.argmax(dim=-1).tolist()
    return Draft(tokens, q.max(dim=-1).values.tolist(), q, ["d"] * k), p


def test_token_v3_greedy_is_leviathans_lossy_greedy_rule():
    # Leviathan et al.: keep draft x iff p(x) >= (1 - alpha) max p; the first failure emits argmax p.
    for seed in range(40):
        block, p = _greedy_block(seed)
        for alpha in (0.0, 0.2, 0.5, 0.9):
            verdict = VerifyReview(Verification("token-v3", alpha), greedy=True).review(block, p, 1.0, None)
            kept = 0
            while kept < len(block) and p[kept, block.tokens[kept]] >= (1 - alpha) * p[kept].max():
                kept += 1
            assert (verdict.accepted, verdict.token) == (kept, int(p[kept].argmax()))
            argmax_kept = sum(block.tokens[i] == int(p[i].argmax()) for i in range(kept))
            assert verdict.off_target == kept - argmax_kept  # kept non-argmax tokens are off-target


def test_opt_equals_diff_under_greedy():
    # Lemma 9: with one-hot q~ and p~, the optimal speculative rule is the sequential Diff rule.
    for seed in range(40):
        block, p = _greedy_block(seed)
        for alpha in (-0.5, 0.0, 0.1, 0.3, 0.7):
            opt = VerifyReview(Verification("opt", alpha), greedy=True).review(block, p, 1.0, None)
            diff = VerifyReview(Verification("diff", alpha), greedy=True).review(block, p, 1.0, None)
            assert (opt.accepted, opt.token) == (diff.accepted, diff.token)


@pytest.mark.parametrize("rule", FUZZY_RULES)
def test_fuzzy_greedy_keeps_while_the_divergence_is_under_t(rule):
    kind = rule[len("fuzzy-") :]
    for seed in range(20):
        block, p = _greedy_block(seed)
        for t in (0.05, 0.3, 1.0):
            verdict = VerifyReview(Verification(rule, t), greedy=True).review(block, p, 1.0, None)
            kept = 0
            while kept < len(block) and (
                block.tokens[kept] == int(p[kept].argmax()) or float(divergence(kind, p[kept], block.dists[kept])) < t
            ):
                kept += 1
            assert verdict.accepted == kept


def test_divergences_match_their_definitions():
    p, q = torch.tensor([0.9, 0.1]), torch.tensor([0.1, 0.9])
    kl = 0.9 * math.log(9) + 0.1 * math.log(1 / 9)
    assert float(divergence("kl", p, q)) == pytest.approx(kl, rel=1e-5)
    assert float(divergence("kl-rev", p, q)) == pytest.approx(kl, rel=1e-5)  # symmetric pair
    assert float(divergence("tv", p, q)) == pytest.approx(0.8)
    assert float(divergence("js", p, q)) == pytest.approx(0.3681, abs=1e-4)  # Holsman et al.'s table
    assert float(divergence("js", p, torch.tensor([0.0, 1.0]))) <= math.log(2) + 1e-6
    assert math.isinf(float(divergence("kl", p, torch.tensor([1.0, 0.0]))))


def test_lossy_greedy_is_exact_and_strict_greedy_rules_keep_only_argmax():
    for seed in range(20):
        block, p = _greedy_block(seed)
        best = p.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(block) and block.tokens[kept] == best[kept]:
            kept += 1
        rules = [("lossy", 0.7)] + [(r, STRICT_ALPHA[r]) for r in RULES if r != "exact"]
        for rule, alpha in rules:
            verdict = VerifyReview(Verification(rule, alpha), greedy=True).review(block, p, 1.0, None)
            assert (verdict.accepted, verdict.token, verdict.off_target) == (kept, best[kept], 0), rule


# --- knobs -------------------------------------------------------------------------------------------


def _acceptance(v: Verification, q: torch.Tensor, p: torch.Tensor) -> float:
    pi = target_distribution(v, q, p)
    return float((q * torch.clamp(pi / q, max=1.0)).sum())


@pytest.mark.parametrize("rule", ["lossy", "chow", "diff", "opt"])
def test_acceptance_never_falls_as_alpha_grows(rule):
    low, high = (0.0, 0.95) if rule == "lossy" else (-1.0, 1.0)
    alphas = [low + (high - low) * i / 20 for i in range(21)]
    for seed in range(30):
        q, p = torch.tensor(_dist(100 + seed, 1.2)), torch.tensor(_dist(200 + seed, 1.8))
        rates = [_acceptance(Verification(rule, a), q, p) for a in alphas]
        assert all(b >= a - 1e-6 for a, b in itertools.pairwise(rates)), (rule, seed, rates)
        assert rates[0] == pytest.approx(1 - float((q - p).clamp_min(0).sum()), abs=1e-6)  # strict: SD's rate


@pytest.mark.parametrize("rule", ["token-v1", "token-v2", "token-v3"])
def test_token_rules_span_sd_to_the_drafter_but_not_monotonically(rule):
    # From SD's acceptance at alpha = -1 to 1 (pi = q) at alpha = 1. In between acceptance can FALL as
    # alpha grows (a monotonicity test would assume otherwise): a token that becomes
    # acceptable stops feeding eta = q(unacceptable), and every token still unacceptable is kept with
    # probability min(1, eta p / q), which shrinks. Example: seed 0 below, alpha crossing 0 for v2/v3.
    falls = 0
    for seed in range(30):
        q, p = torch.tensor(_dist(100 + seed, 1.2)), torch.tensor(_dist(200 + seed, 1.8))
        rates = [_acceptance(Verification(rule, -1 + 2 * i / 20), q, p) for i in range(21)]
        assert rates[0] == pytest.approx(1 - float((q - p).clamp_min(0).sum()), abs=1e-6)
        assert rates[-1] == pytest.approx(1.0, abs=1e-6)
        falls += any(b < a - 1e-4 for a, b in itertools.pairwise(rates))
    assert falls > 0  # the non-monotonicity is real, for all three rules


def test_bad_knobs_name_their_field():
    with pytest.raises(ValueError, match="verification.rule"):
        Verification("token-v4")
    with pytest.raises(ValueError, match=r"verification.alpha .*\[-1, 1\]"):
        Verification("token-v3", 1.5)
    with pytest.raises(ValueError, match=r"verification.alpha .*\[0, 1\)"):
        Verification("lossy", 1.0)
    with pytest.raises(ValueError, match="verification.alpha"):
        Verification("fuzzy-js", -0.1)
    with pytest.raises(ValueError, match="verification.alpha"):
        Verification("chow", float("nan"))
    with pytest.raises(ValueError, match="verification.beta"):
        Verification("lossy", 0.5, 0.4)
    assert Verification("lossy", 0.0, 1.0).exact and not Verification("lossy", 0.0, 2.0).exact
    assert Verification("token-v3").exact and not Verification("token-v3", 0.2).exact
