"""`cascade-service bench lossy`: cost-quality curves of the final-verifier rules over their knobs.

For every rule and knob value the same cascade decodes the same held-out prompts with the same seeds.
Cost: target calls per token and tokens/s. Quality, from core.verify's exact per-position accounting
(o: the distribution an emitted token was actually drawn from, p: the target's):
- quality loss = the expected total-variation deviation TV(o, p) per token: how far the output's
  distribution is from the target's. It is the curves' y axis and the basis of "equal quality loss";
- the expected change of the target's log-likelihood per token, E_p[log p] - E_o[log p]. It is no
  basis for "equal loss": a rule that keeps the target's likeliest drafts RAISES the likelihood above
  the target's own samples (negative values), so it rewards sharpening, not fidelity;
- from the target model run afterwards on the produced text (teacher-forced, untimed; noisy, kept
  for reference): agreement, the share of generated tokens equal to the target's argmax after the
  same prefix, and the target's mean log-probability (temperature 1) per generated token.
For two rules the speed at equal quality loss is read off their curves (the best speed at no more
than that loss).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import GenerationConfig
from ..core.types import Context
from ..core.verify import Verification
from ..inprocess import InProcess

# Knob grids: from the strict end (exact output) towards the drafter. Ranges differ per rule (docs/lossy.md).
GRIDS: dict[str, tuple[float, ...]] = {
    "lossy": (0.0, 0.2, 0.4, 0.6, 0.8, 0.9),
    "lossy-tuned": (0.2, 0.4, 0.6, 0.8, 0.9),
    "chow": (0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
    "diff": (0.0, 0.1, 0.2, 0.4, 0.6, 1.0),
    "opt": (0.0, 0.25, 0.5, 0.75, 1.0),
    "token-v1": (0.0, 0.1, 0.2, 0.4, 0.7, 1.0),
    "token-v2": (0.0, 0.1, 0.2, 0.4, 0.7, 1.0),
    "token-v3": (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0),
    "fuzzy-js": (0.02, 0.05, 0.1, 0.2, 0.4),
    "fuzzy-kl": (0.05, 0.1, 0.3, 0.6, 1.0),
    "fuzzy-kl-rev": (0.05, 0.1, 0.3, 0.6, 1.0),
    "fuzzy-tv": (0.1, 0.2, 0.4, 0.6, 0.8),
}


def verification_for(rule: str, alpha: float) -> Verification:
    if rule == "lossy-tuned":
        return Verification("lossy", alpha, None)
    return Verification(rule, alpha)


@dataclass
class Point:
    rule: str
    alpha: float
    tokens: int
    seconds: float
    target_calls: int
    off_target: int
    tv: float
    ll_loss: float
    agreement: float
    loglik: float

    @property
    def loss(self) -> float:
        """Quality loss: expected TV deviation from the target's distributions, per token."""
        return self.tv / self.tokens if self.tokens else 0.0

    @property
    def ll_change(self) -> float:
        """Expected drop of the target's log-likelihood per token (nats; negative: a rise)."""
        return self.ll_loss / self.tokens if self.tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def calls_per_token(self) -> float:
        return self.target_calls / self.tokens if self.tokens else 0.0


def run_point(
    engine: InProcess,
    rule: str,
    alpha: float,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    temperature: float,
    seeds: Sequence[int],
) -> Point:
    """Decode every prompt with every seed under one rule setting; score the outputs with the target."""
    v = Verification("exact") if rule == "exact" else verification_for(rule, alpha)
    tokens = calls = off = 0
    seconds = tv = ll_loss = 0.0
    agree = 0
    loglik = 0.0
    for prompt in prompts:
        for seed in seeds:
            gen = GenerationConfig(  # every round drafts: the rule's cost and quality, not the floor's choice
                max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, verification=v, speculation="fixed"
            )
            start = time.perf_counter()
            result = engine.generate(prompt, gen)
            seconds += time.perf_counter() - start
            out = result.token_ids
            tokens += len(out)
            calls += result.stats.target_calls
            off += result.stats.off_target_tokens
            tv += result.stats.tv_deviation
            ll_loss += result.stats.loglik_loss
            a, ll = _score(engine, prompt, out)
            agree += a
            loglik += ll
    return Point(rule, alpha, tokens, seconds, calls, off, tv, ll_loss, agree / max(1, tokens), loglik / max(1, tokens))


def _score(engine: InProcess, prompt: list[int], out: list[int]) -> tuple[int, float]:
    """(tokens equal to the target's argmax, summed target log-probability) over `out`, one pass."""
    if not out:
        return 0, 0.0
    logits = engine.local_target().scorer().logits(Context(prompt + out, 0), len(out))  # row j predicts out[j]
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(out)
    agree = int((logits.argmax(dim=-1).cpu() == ids).sum())
    return agree, float(logp[torch.arange(len(out)), ids].sum())


def frontier(points: Sequence[Point], speed=lambda p: p.tokens_per_s) -> list[tuple[float, float]]:
    """(quality loss, best speed at no more than that loss) for one rule, sorted by loss."""
    pairs = sorted((max(0.0, p.loss), speed(p)) for p in points)
    best, out = 0.0, []
    for loss, value in pairs:
        best = max(best, value)
        out.append((loss, best))
    return out


def speed_at(front: list[tuple[float, float]], loss: float) -> float | None:
    """The best speed a rule reaches at quality loss <= `loss` (None: none of its points is that good)."""
    eligible = [value for l, value in front if l <= loss + 1e-12]
    return max(eligible) if eligible else None


SPEEDS = {"tok_s": lambda p: p.tokens_per_s, "tokens_per_target_call": lambda p: 1.0 / p.calls_per_token}


def compare(points: dict[str, list[Point]], fast: str, slow: str) -> list[dict]:
    """Speed ratios fast/slow (tokens/s, and tokens per target call) at each quality-loss level the
    slow rule's points reach."""
    rows = []
    for loss, _ in frontier(points[slow]):
        row: dict = {"quality_loss": round(loss, 5)}
        for name, speed in SPEEDS.items():
            slow_speed = speed_at(frontier(points[slow], speed), loss)
            fast_speed = speed_at(frontier(points[fast], speed), loss)
            if fast_speed is None or not slow_speed:
                break
            row[f"{slow}_{name}"], row[f"{fast}_{name}"] = round(slow_speed, 3), round(fast_speed, 3)
            row[f"ratio_{name}"] = round(fast_speed / slow_speed, 3)
        else:
            rows.append(row)
    return rows


def plot(points: dict[str, list[Point]], reference: Point, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for rule, pts in points.items():
        style = "-o" if rule in ("token-v3", "lossy") else "--."
        axes[0].plot([p.calls_per_token for p in pts], [p.loss for p in pts], style, label=rule)
        axes[1].plot([p.tokens_per_s for p in pts], [p.loss for p in pts], style, label=rule)
        axes[2].plot([p.tokens_per_s for p in pts], [p.ll_change for p in pts], style, label=rule)
    for ax, (x, y) in zip(
        axes,
        (
            ("target calls per token", "quality loss: expected TV deviation per token"),
            ("tokens/s", "quality loss: expected TV deviation per token"),
            ("tokens/s", "expected log-likelihood drop per token (nats)"),
        ),
    ):
        ax.axhline(0.0, color="k", lw=0.8, ls=":")
        ax.plot([reference.calls_per_token if ax is axes[0] else reference.tokens_per_s], [0.0], "k*", ms=10)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"final-verifier rules: cost vs quality loss (star: exact, {reference.tokens_per_s:.0f} tok/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    engine: InProcess,
    prompts: Sequence[list[int]],
    rules: Sequence[str],
    max_new_tokens: int,
    temperature: float,
    seeds: Sequence[int],
    out: Path,
    command: str,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    run_point(engine, "exact", 0.0, prompts[:1], 8, temperature, seeds[:1])  # warm-up
    reference = run_point(engine, "exact", 0.0, prompts, max_new_tokens, temperature, seeds)
    points: dict[str, list[Point]] = {}
    for rule in rules:
        points[rule] = [run_point(engine, rule, a, prompts, max_new_tokens, temperature, seeds) for a in GRIDS[rule]]
        best = max(points[rule], key=lambda p: p.tokens_per_s)
        print(f"{rule:<13} done: up to {best.tokens_per_s:.1f} tok/s (exact {reference.tokens_per_s:.1f})", flush=True)
    results = {
        "command": command,
        "temperature": temperature,
        "seeds": list(seeds),
        "max_new_tokens": max_new_tokens,
        "prompts": len(prompts),
        "exact": _row(reference),
        "rules": {rule: [_row(p) for p in pts] for rule, pts in points.items()},
    }
    if "token-v3" in points and "lossy" in points:
        rows = compare(points, "token-v3", "lossy")
        results["token_v3_vs_lossy"] = {
            "rows": rows,
            **{
                f"median_ratio_{name}": statistics.median(r[f"ratio_{name}"] for r in rows) if rows else None
                for name in SPEEDS
            },
        }
    (out / "lossy.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(points, reference, out / "lossy_curves.png")
    print(markdown(results), end="")
    return results


def _row(p: Point) -> dict:
    return {
        "rule": p.rule,
        "alpha": p.alpha,
        "tokens": p.tokens,
        "tokens_per_s": round(p.tokens_per_s, 2),
        "target_calls_per_token": round(p.calls_per_token, 4),
        "off_target_tokens": p.off_target,
        "tv_deviation": round(p.tv, 3),
        "tv_per_token": round(p.loss, 5),
        "loglik_drop_per_token": round(p.ll_change, 5),
        "agreement": round(p.agreement, 4),
        "loglik": round(p.loglik, 4),
    }


def markdown(results: dict) -> str:
    ex = results["exact"]
    lines = [
        f"exact: {ex['tokens_per_s']:.1f} tok/s, {ex['target_calls_per_token']:.3f} target calls/token, "
        f"agreement {ex['agreement']:.3f}, log-lik {ex['loglik']:.3f}",
        "",
        "| rule | alpha | tok/s | target calls/tok | off-target tokens | TV dev/tok (quality loss) "
        "| expected log-lik drop/tok | agreement (sampled) | log-lik (sampled) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rule, rows in results["rules"].items():
        for r in rows:
            lines.append(
                f"| {rule} | {r['alpha']:g} | {r['tokens_per_s']:.1f} | {r['target_calls_per_token']:.3f} | "
                f"{r['off_target_tokens']} | {r['tv_per_token']:.3f} | "
                f"{r['loglik_drop_per_token']:+.3f} | {r['agreement']:.3f} | {r['loglik']:.3f} |"
            )
    cmp_ = results.get("token_v3_vs_lossy")
    if cmp_:
        lines += [
            "",
            "token-v3 vs lossy (beta 1) at equal quality loss:",
            "",
            "| TV dev/tok <= | lossy tok/s | token-v3 tok/s | ratio | lossy tok/call | token-v3 tok/call | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['quality_loss']:.4f} | {r['lossy_tok_s']:.1f} | {r['token-v3_tok_s']:.1f} | "
            f"{r['ratio_tok_s']:.2f}x | {r['lossy_tokens_per_target_call']:.2f} | "
            f"{r['token-v3_tokens_per_target_call']:.2f} | {r['ratio_tokens_per_target_call']:.2f}x |"
            for r in cmp_["rows"]
        ]
        if cmp_["rows"]:
            lines.append(
                f"\nmedian ratio: {cmp_['median_ratio_tok_s']:.2f}x in tokens/s, "
                f"{cmp_['median_ratio_tokens_per_target_call']:.2f}x in tokens per target call (goal >= 1.2x)"
            )
    return "\n".join(lines) + "\n"
