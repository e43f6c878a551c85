"""`cascade-service bench adaptive`: SpecDec++ stopping against the best fixed draft length.

The drafter under test has K, its own K-matrix entry, swept or capped; greedy and exact. Three settings:
- alone: it drafts for the target (speculative decoding, the paper's setting), K = [[k]];
- `reviews` T (CS Drafting, a reviewing tier): T drafts `other_k` tokens a round, the drafter reviews
  them and what it keeps is its part of the target's block, K = [[k, 0], [0, other_k]];
- `under` T (CS Drafting, a tier drafting under a reviewer): the drafter drafts k tokens a round for
  T, which reviews them and adds `other_k` to the target's block, K = [[other_k, 0], [0, k]].
In each:
- fixed K for every K in the sweep;
- SpecDec++ (acceptance head, stop when P(a rejection) > h) for every h, with a cap of `max_k`;
- the confidence baseline (stop when max q < h) for every h, same cap.
Methods alternate per prompt within each repeat, so machine drift hits all of them alike; tokens/s
is the median over repeats of (all tokens / all seconds). Every output must equal fixed K's (the
target's greedy output): stopping changes block lengths, never tokens.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import GenerationConfig
from ..core.adaptive import AdaptiveLength
from ..inprocess import InProcess


def methods(
    drafter: str,
    ks: Sequence[int],
    max_k: int,
    head: str | None,
    specdec_hs: Sequence[float],
    confidence_hs: Sequence[float],
) -> dict[str, tuple[int, AdaptiveLength | None]]:
    out: dict[str, tuple[int, AdaptiveLength | None]] = {f"fixed K={k}": (k, None) for k in ks}
    if head:
        out.update({f"specdec h={h:g}": (max_k, AdaptiveLength("specdec", h, head)) for h in specdec_hs})
    out.update({f"confidence h={h:g}": (max_k, AdaptiveLength("confidence", h)) for h in confidence_hs})
    return out


@dataclass(frozen=True)
class Setting:
    """Where the drafter under test sits: alone, reviewing `reviews`, or drafting `under` a reviewer."""

    drafter: str
    reviews: str | None = None
    under: str | None = None
    other_k: int = 2  # the other tier's entry

    def tiers(self) -> list[str]:
        """Largest first, as `InProcess.variant` takes them."""
        if self.reviews:
            return [self.drafter, self.reviews]
        if self.under:
            return [self.under, self.drafter]
        return [self.drafter]

    def k_matrix(self, k: int) -> list[list[int]]:
        if self.reviews:
            return [[k, 0], [0, self.other_k]]
        return [[self.other_k, 0], [0, k]] if self.under else [[k]]

    def describe(self) -> str:
        if self.reviews:
            return f"{self.drafter} reviewing {self.reviews} (K = [[k, 0], [0, {self.other_k}]])"
        if self.under:
            return f"{self.drafter} drafting under {self.under} (K = [[{self.other_k}, 0], [0, k]])"
        return f"{self.drafter} drafting alone (K = [[k]])"


def run(
    engine: InProcess,
    setting: Setting,
    prompts: Sequence[list[int]],
    table: dict[str, tuple[int, AdaptiveLength | None]],
    max_new_tokens: int,
    repeats: int,
    out: Path,
    command: str,
) -> dict:
    engines = {
        name: engine.variant(setting.tiers(), setting.k_matrix(k), 1.0, None, {setting.drafter: a} if a else None)
        for name, (k, a) in table.items()
    }
    gen = GenerationConfig(max_new_tokens=max_new_tokens, speculation="fixed")  # the stopping rules, every round
    for e in engines.values():  # warm-up: lazy initialisation everywhere, untimed
        e.generate(prompts[0][:8], GenerationConfig(max_new_tokens=8))
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    calls: dict[str, int] = {}
    blocks: dict[str, list[float]] = {}
    for rep in range(repeats):
        tokens = {name: 0 for name in engines}
        seconds = {name: 0.0 for name in engines}
        names = list(engines)
        for i, prompt in enumerate(prompts):
            order = names[(rep + i) % len(names) :] + names[: (rep + i) % len(names)]  # rotate who goes first
            for name in order:
                start = time.perf_counter()
                result = engines[name].generate(prompt, gen)
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(result.token_ids)
                if rep == 0:
                    outputs.setdefault(name, []).append(result.token_ids)
                    calls[name] = calls.get(name, 0) + result.stats.target_calls
                    review = result.stats.reviews.get(setting.under or result.stats.target)  # the drafter's blocks
                    if review is not None and review.reviews:
                        blocks.setdefault(name, []).append(review.drafted / review.reviews)
        for name in engines:
            speeds[name].append(tokens[name] / seconds[name])
    reference = outputs[next(iter(table))]
    rows: dict[str, dict[str, Any]] = {
        name: {
            "tokens_per_s": round(statistics.median(speeds[name]), 2),
            "tokens_per_s_repeats": [round(s, 2) for s in speeds[name]],
            "target_calls_per_token": round(calls[name] / max(1, sum(map(len, outputs[name]))), 4),
            "mean_block": round(statistics.mean(blocks.get(name, [0.0])), 2),
            "identical": outputs[name] == reference,
        }
        for name in engines
    }
    fixed = {n: r for n, r in rows.items() if n.startswith("fixed")}
    best_fixed = max(fixed, key=lambda n: fixed[n]["tokens_per_s"])
    summary = {}
    for family in ("specdec", "confidence"):
        mine = {n: r for n, r in rows.items() if n.startswith(family)}
        if mine:
            best = max(mine, key=lambda n: mine[n]["tokens_per_s"])
            summary[family] = {
                "best": best,
                "ratio_vs_best_fixed": round(mine[best]["tokens_per_s"] / fixed[best_fixed]["tokens_per_s"], 3),
            }
    results = {
        "command": command,
        "drafter": setting.drafter,
        "reviews": setting.reviews,
        "under": setting.under,
        "other_k": setting.other_k if setting.reviews or setting.under else None,
        "setting": setting.describe(),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "methods": rows,
        "best_fixed": best_fixed,
        "summary": summary,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "adaptive.json").write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results), end="")
    return results


def markdown(results: dict) -> str:
    lines = [
        f"setting: {results['setting']}",
        "",
        "| method | tok/s (median) | target calls/token | drafter's mean block | identical |",
        "|---|---|---|---|---|",
    ]
    for name, r in results["methods"].items():
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['target_calls_per_token']:.3f} | {r['mean_block']:.2f} | "
            f"{r['identical']} |"
        )
    lines.append(f"\nbest fixed: {results['best_fixed']}")
    for family, s in results["summary"].items():
        lines.append(
            f"best {family}: {s['best']}, {s['ratio_vs_best_fixed']:.3f}x the best fixed K"
            + (" (goal >= 1.07x)" if family == "specdec" else "")
        )
    return "\n".join(lines) + "\n"
