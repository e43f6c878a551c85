"""`cascade-service bench --lossy`: cost-quality curves of the final-verifier rules over their knobs.

For every rule and knob value the same cascade decodes the same held-out prompts with the same seeds.
Cost: target calls per token (deterministic given the outputs) and tokens/s. Quality, both from the
target model run afterwards on the produced text (teacher-forced, untimed):
- agreement: the share of generated tokens equal to the target's argmax after the same prefix, i.e.
  agreement with the target's greedy choice at every step;
- log-likelihood: the target's mean log-probability (temperature 1) per generated token.
The exact rule is the reference; "quality loss" is its log-likelihood minus a rule's. For two rules
the speed at equal quality loss is read off their curves (best speed at no more than that loss).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..config import GenerationConfig
from ..core.types import Context
from ..core.verify import Verification
from ..engine import Engine

# Knob grids: from the strict end (exact output) towards the drafter. Ranges differ per rule (README).
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
    agreement: float
    loglik: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def calls_per_token(self) -> float:
        return self.target_calls / self.tokens if self.tokens else 0.0


def run_point(engine: Engine, rule: str, alpha: float, prompts: Sequence[list[int]], max_new_tokens: int,
              temperature: float, seeds: Sequence[int]) -> Point:
    """Decode every prompt with every seed under one rule setting; score the outputs with the target."""
    v = Verification("exact") if rule == "exact" else verification_for(rule, alpha)
    tokens = calls = off = 0
    seconds = tv = 0.0
    agree = 0
    loglik = 0.0
    for prompt in prompts:
        for seed in seeds:
            gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, verification=v)
            start = time.perf_counter()
            result = engine.generate(prompt, gen)
            seconds += time.perf_counter() - start
            out = result.token_ids
            tokens += len(out)
            calls += result.stats.target_calls
            off += result.stats.off_target_tokens
            tv += result.stats.tv_deviation
            a, ll = _score(engine, prompt, out)
            agree += a
            loglik += ll
    return Point(rule, alpha, tokens, seconds, calls, off, tv, agree / max(1, tokens), loglik / max(1, tokens))


def _score(engine: Engine, prompt: list[int], out: list[int]) -> tuple[int, float]:
    """(tokens equal to the target's argmax, summed target log-probability) over `out`, one pass."""
    if not out:
        return 0, 0.0
    logits = engine.target.scorer().logits(Context(prompt + out, 0), len(out))  # row j predicts out[j]
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(out)
    agree = int((logits.argmax(dim=-1).cpu() == ids).sum())
    return agree, float(logp[torch.arange(len(out)), ids].sum())


def frontier(points: Sequence[Point], reference: Point) -> list[tuple[float, float]]:
    """(quality loss, best tokens/s at no more than that loss) for one rule, sorted by loss."""
    pairs = sorted((max(0.0, reference.loglik - p.loglik), p.tokens_per_s) for p in points)
    best, out = 0.0, []
    for loss, speed in pairs:
        best = max(best, speed)
        out.append((loss, best))
    return out


def speed_at(front: list[tuple[float, float]], loss: float) -> float | None:
    """The best speed a rule reaches at quality loss <= `loss` (None: none of its points is that good)."""
    eligible = [speed for l, speed in front if l <= loss + 1e-12]
    return max(eligible) if eligible else None


def compare(points: dict[str, list[Point]], reference: Point, fast: str, slow: str) -> list[dict]:
    """Speed ratio fast/slow at each quality-loss level the slow rule's points reach."""
    f_front, s_front = frontier(points[fast], reference), frontier(points[slow], reference)
    rows = []
    for loss, slow_speed in s_front:
        fast_speed = speed_at(f_front, loss)
        if fast_speed is not None and slow_speed > 0:
            rows.append({"quality_loss": round(loss, 4), f"{slow}_tok_s": round(slow_speed, 1),
                         f"{fast}_tok_s": round(fast_speed, 1), "ratio": round(fast_speed / slow_speed, 3)})
    return rows


def plot(points: dict[str, list[Point]], reference: Point, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for rule, pts in points.items():
        style = "-o" if rule in ("token-v3", "lossy") else "--."
        axes[0].plot([p.calls_per_token for p in pts], [p.loglik for p in pts], style, label=rule)
        axes[1].plot([p.tokens_per_s for p in pts], [p.loglik for p in pts], style, label=rule)
        axes[2].plot([p.tokens_per_s for p in pts], [p.agreement for p in pts], style, label=rule)
    for ax, (x, y) in zip(axes, (("target calls per token", "target log-likelihood per token"),
                                 ("tokens/s", "target log-likelihood per token"),
                                 ("tokens/s", "agreement with the target's greedy choice"))):
        ax.axhline(reference.loglik if "log" in y else reference.agreement, color="k", lw=0.8, ls=":")
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("final-verifier rules: cost vs quality (dotted: exact)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(engine: Engine, prompts: Sequence[list[int]], rules: Sequence[str], max_new_tokens: int,
        temperature: float, seeds: Sequence[int], out: Path, command: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    run_point(engine, "exact", 0.0, prompts[:1], 8, temperature, seeds[:1])  # warm-up
    reference = run_point(engine, "exact", 0.0, prompts, max_new_tokens, temperature, seeds)
    points: dict[str, list[Point]] = {}
    for rule in rules:
        points[rule] = [run_point(engine, rule, a, prompts, max_new_tokens, temperature, seeds) for a in GRIDS[rule]]
        best = max(points[rule], key=lambda p: p.tokens_per_s)
        print(f"{rule:<13} done: up to {best.tokens_per_s:.1f} tok/s (exact {reference.tokens_per_s:.1f})", flush=True)
    results = {
        "command": command, "temperature": temperature, "seeds": list(seeds), "max_new_tokens": max_new_tokens,
        "prompts": len(prompts),
        "exact": _row(reference),
        "rules": {rule: [_row(p) for p in pts] for rule, pts in points.items()},
    }
    if "token-v3" in points and "lossy" in points:
        rows = compare(points, reference, "token-v3", "lossy")
        results["token_v3_vs_lossy"] = {"rows": rows,
                                        "median_ratio": statistics.median(r["ratio"] for r in rows) if rows else None}
    (out / "lossy.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(points, reference, out / "lossy_curves.png")
    print(markdown(results), end="")
    return results


def _row(p: Point) -> dict:
    return {"rule": p.rule, "alpha": p.alpha, "tokens": p.tokens, "tokens_per_s": round(p.tokens_per_s, 2),
            "target_calls_per_token": round(p.calls_per_token, 4), "off_target_tokens": p.off_target,
            "tv_deviation": round(p.tv, 3), "agreement": round(p.agreement, 4), "loglik": round(p.loglik, 4)}


def markdown(results: dict) -> str:
    ex = results["exact"]
    lines = [f"exact: {ex['tokens_per_s']:.1f} tok/s, {ex['target_calls_per_token']:.3f} target calls/token, "
             f"agreement {ex['agreement']:.3f}, log-lik {ex['loglik']:.3f}", "",
             "| rule | alpha | tok/s | target calls/tok | off-target | TV dev | agreement | log-lik | loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rule, rows in results["rules"].items():
        for r in rows:
            lines.append(f"| {rule} | {r['alpha']:g} | {r['tokens_per_s']:.1f} | {r['target_calls_per_token']:.3f} | "
                         f"{r['off_target_tokens']} | {r['tv_deviation']:.1f} | {r['agreement']:.3f} | "
                         f"{r['loglik']:.3f} | {ex['loglik'] - r['loglik']:+.3f} |")
    cmp_ = results.get("token_v3_vs_lossy")
    if cmp_:
        lines += ["", "token-v3 vs lossy (beta 1) at equal quality loss:", "",
                  "| quality loss <= | lossy tok/s | token-v3 tok/s | ratio |", "|---|---|---|---|"]
        lines += [f"| {r['quality_loss']:.3f} | {r['lossy_tok_s']:.1f} | {r['token-v3_tok_s']:.1f} | {r['ratio']:.2f}x |"
                  for r in cmp_["rows"]]
        if cmp_["median_ratio"] is not None:
            lines.append(f"\nmedian ratio {cmp_['median_ratio']:.2f}x (goal >= 1.2x)")
    return "\n".join(lines) + "\n"
