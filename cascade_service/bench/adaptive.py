"""`cascade-service bench --adaptive`: SpecDec++ stopping against the best fixed draft length.

One drafter drafts for the target (speculative decoding, the paper's setting), greedy and exact; with
`reviews` it is a reviewing tier instead (CS Drafting: `reviews` drafts `sub_k` tokens a round, the
drafter reviews them and its output is the target's block), K below meaning the drafter's entry:
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
from pathlib import Path
from typing import Sequence

from ..config import GenerationConfig
from ..core.adaptive import AdaptiveLength
from ..engine import Engine


def methods(drafter: str, ks: Sequence[int], max_k: int, head: str | None, specdec_hs: Sequence[float],
            confidence_hs: Sequence[float]) -> dict[str, tuple[int, AdaptiveLength | None]]:
    out: dict[str, tuple[int, AdaptiveLength | None]] = {f"fixed K={k}": (k, None) for k in ks}
    if head:
        out.update({f"specdec h={h:g}": (max_k, AdaptiveLength("specdec", h, head)) for h in specdec_hs})
    out.update({f"confidence h={h:g}": (max_k, AdaptiveLength("confidence", h)) for h in confidence_hs})
    return out


def k_matrix(k: int, reviews: str | None, sub_k: int) -> list[list[int]]:
    """The drafter adds k tokens to the target's block; under it, `reviews` adds sub_k to each of its rounds."""
    return [[k, 0], [0, sub_k]] if reviews else [[k]]


def run(engine: Engine, drafter: str, prompts: Sequence[list[int]], table: dict[str, tuple[int, AdaptiveLength | None]],
        max_new_tokens: int, repeats: int, out: Path, command: str, reviews: str | None = None,
        sub_k: int = 2) -> dict:
    tiers = [drafter, reviews] if reviews else [drafter]
    engines = {name: engine.variant(tiers, k_matrix(k, reviews, sub_k), 1.0, None, {drafter: a} if a else None)
               for name, (k, a) in table.items()}
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
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
            order = names[(rep + i) % len(names):] + names[:(rep + i) % len(names)]  # rotate who goes first
            for name in order:
                start = time.perf_counter()
                result = engines[name].generate(prompt, gen)
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(result.token_ids)
                if rep == 0:
                    outputs.setdefault(name, []).append(result.token_ids)
                    calls[name] = calls.get(name, 0) + result.stats.target_calls
                    review = result.stats.reviews.get(result.stats.target)
                    if review is not None and review.reviews:
                        blocks.setdefault(name, []).append(review.drafted / review.reviews)
        for name in engines:
            speeds[name].append(tokens[name] / seconds[name])
    reference = outputs[next(iter(table))]
    rows = {name: {"tokens_per_s": round(statistics.median(speeds[name]), 2),
                   "tokens_per_s_repeats": [round(s, 2) for s in speeds[name]],
                   "target_calls_per_token": round(calls[name] / max(1, sum(map(len, outputs[name]))), 4),
                   "mean_block": round(statistics.mean(blocks.get(name, [0.0])), 2),
                   "identical": outputs[name] == reference}
            for name in engines}
    fixed = {n: r for n, r in rows.items() if n.startswith("fixed")}
    best_fixed = max(fixed, key=lambda n: fixed[n]["tokens_per_s"])
    summary = {}
    for family in ("specdec", "confidence"):
        mine = {n: r for n, r in rows.items() if n.startswith(family)}
        if mine:
            best = max(mine, key=lambda n: mine[n]["tokens_per_s"])
            summary[family] = {"best": best, "ratio_vs_best_fixed": round(mine[best]["tokens_per_s"] /
                                                                         fixed[best_fixed]["tokens_per_s"], 3)}
    results = {"command": command, "drafter": drafter, "reviews": reviews, "sub_k": sub_k if reviews else None,
               "prompts": len(prompts), "max_new_tokens": max_new_tokens,
               "repeats": repeats, "methods": rows, "best_fixed": best_fixed, "summary": summary}
    out.mkdir(parents=True, exist_ok=True)
    (out / "adaptive.json").write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results), end="")
    return results


def markdown(results: dict) -> str:
    setting = (f"{results['drafter']} reviewing {results['reviews']} (K = [[k, 0], [0, {results['sub_k']}]])"
               if results.get("reviews") else f"{results['drafter']} drafting alone (K = [[k]])")
    lines = [f"setting: {setting}", "", "| method | tok/s (median) | target calls/token | mean block | identical |", "|---|---|---|---|---|"]
    for name, r in results["methods"].items():
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['target_calls_per_token']:.3f} | {r['mean_block']:.2f} | "
                     f"{r['identical']} |")
    lines.append(f"\nbest fixed: {results['best_fixed']}")
    for family, s in results["summary"].items():
        lines.append(f"best {family}: {s['best']}, {s['ratio_vs_best_fixed']:.3f}x the best fixed K"
                     + (" (goal >= 1.07x)" if family == "specdec" else ""))
    return "\n".join(lines) + "\n"
