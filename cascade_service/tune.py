"""`cascade-service tune`: choose the K-matrix and leniency from measured acceptance and cost.

1. Measure each model drafter's cost (single-token step time / the target's) and its acceptance as a
   lone drafter; Corollary 4.2 of the paper (EWIF) then gives its best single-drafter length k*.
2. Build a grid of K-matrices around k* (with and without horizontal tails, several leniencies).
3. Halving grid search (the paper's own method, §6.1): measure every candidate briefly, keep the best
   third, measure those longer, and so on; the config's own schedule always competes.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from .config import MAG, SUFFIX, GenerationConfig, StatisticalConfig, load_config
from .core.cascade import Lookup
from .core.ewif import best_k
from .core.schedule import Schedule, ScheduleError
from .inprocess import InProcess
from .prompts import read_prompts

OBJECTIVES = ("tokens_per_s", "swi_params", "swi_measured")


@dataclass(frozen=True)
class Candidate:
    k_matrix: tuple[tuple[int, ...], ...]
    leniency: float
    lookup: Lookup | None = None


@dataclass
class Trial:
    candidate: Candidate
    tokens_per_s: float
    swi_params: float
    swi_measured: float
    mean_accepted_length: float

    def score(self, objective: str) -> float:
        return getattr(self, objective)


def measure(
    engine: InProcess,
    candidate: Candidate,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    costs: dict[str, dict[str, float]],
) -> Trial:
    variant = engine.variant(
        [d.name for d in engine.cascade.drafters], candidate.k_matrix, candidate.leniency, candidate.lookup
    )
    gen = GenerationConfig(max_new_tokens=max_new_tokens, speculation="fixed")  # each schedule as it is
    tokens = seconds = target_calls = 0.0
    swi = {"params": 0.0, "measured": 0.0}
    for ids in prompts:
        start = time.perf_counter()
        result = variant.generate(ids, gen)
        seconds += time.perf_counter() - start
        tokens += result.stats.generated
        target_calls += result.stats.target_calls
        for name in swi:  # SWI over all prompts = total tokens / total weighted calls
            swi[name] += result.stats.generated / max(result.stats.swi(costs[name]), 1e-9)
    return Trial(
        candidate, tokens / seconds, tokens / swi["params"], tokens / swi["measured"], tokens / max(target_calls, 1)
    )


def lone_drafter_k(
    engine: InProcess, prompts: Sequence[list[int]], costs: dict[str, float], probe_k: int = 4
) -> dict[str, int]:
    """Each model drafter's acceptance as a lone drafter, turned into its EWIF-best k (Corollary 4.2)."""
    best = {}
    for d in engine.cascade.drafters:
        variant = engine.variant([d.name], [[10 if isinstance(d, StatisticalConfig) else probe_k]])
        accepted = rejections = 0
        for ids in prompts:
            review = variant.generate(ids, GenerationConfig(max_new_tokens=48, speculation="fixed")).stats.reviews.get(
                engine.target.name
            )
            if review:
                accepted += review.accepted
                rejections += review.rejections
        # Per-token acceptance: positions after a rejection are never judged, so accepted / drafted
        # would undercount; each review is a geometric trial, whose MLE is accepted / (accepted + rejections).
        alpha = min(accepted / (accepted + rejections), 0.99) if accepted + rejections else 0.0
        best[d.name] = best_k(alpha, costs.get(d.name, 0.0), 12)
        _log(
            f"  {d.name}: acceptance {alpha:.2f} as a lone drafter, cost {costs.get(d.name, 0.0):.3f}"
            f" -> k* = {best[d.name]}"
        )
    return best


# MaG-first gate at the target (core.schedule.Lookup): off, prompt-lookup's own 10 tokens, or longer blocks
# for text that repeats for a long stretch.
LOOKUPS = (None, Lookup(2, 10), Lookup(2, 20))


def candidate_grid(
    drafters: Sequence[str], k_star: dict[str, int], statistical: Collection[str] = (MAG, SUFFIX)
) -> list[Candidate]:
    """K-matrices around each drafter's k*: diagonal choices plus an optional tail from the next drafter,
    each with and without the lookup gate when a statistical drafter (`statistical`: MaG, suffix
    decoding) is there. Blocks fill by the config's `schedule.fill` (core.schedule), as they run."""
    n = len(drafters)
    row_options = []
    for r in range(n):
        d = drafters[r]  # the drafter on row r's diagonal, T_{r+1}
        if r and drafters[r - 1] in statistical:  # reviewer T_r drafts statistically: it never reviews
            row_options.append([(0, 0)])
            continue
        if d in statistical:
            diag = [4, 10]
        elif r == 0:
            diag = sorted({max(1, k_star[d] - 2), k_star[d], k_star[d] + 2})
        else:
            diag = sorted({1, k_star[d]})  # inner rows: a short or an EWIF-length block
        tails = [0, 5 if drafters[r + 1] in statistical else 2] if r + 1 < n else [0]
        row_options.append([(a, b) for a in diag for b in tails])
    leniencies = [1.0, 2.0] if n >= 2 else [1.0]
    grid = []
    for rows in itertools.product(*row_options):
        k = [[0] * n for _ in range(n)]
        for r, (own, tail) in enumerate(rows):
            k[r][r] = own
            if r + 1 < n:
                k[r][r + 1] = tail
        try:
            Schedule.parse(k, drafters, statistical)
        except ScheduleError:
            continue  # e.g. a drafter that no reachable row uses
        # The gate goes in front of a statistical drafter: suffix decoding where the config has it, else MaG.
        gate = next((name for name in (SUFFIX, MAG) if name in drafters and name in statistical), None)
        lookups = tuple(lk if lk is None else replace(lk, tier=gate) for lk in LOOKUPS) if gate else (None,)
        grid += [Candidate(tuple(map(tuple, k)), lenience, lk) for lenience in leniencies for lk in lookups]
    return grid


def halving_search(
    engine: InProcess,
    candidates: list[Candidate],
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    objective: str,
    costs,
) -> list[Trial]:
    stages = [
        (1, min(32, max_new_tokens)),
        (2, min(64, max_new_tokens)),
        (4, max_new_tokens),
        (len(prompts), max_new_tokens),
    ]
    alive = list(dict.fromkeys(candidates))
    trials: list[Trial] = []
    for i, (n_prompts, n_tokens) in enumerate(stages):
        trials = [measure(engine, c, prompts[:n_prompts], n_tokens, costs) for c in alive]
        trials.sort(key=lambda t: t.score(objective), reverse=True)
        keep = max(3, len(trials) // 3)  # the best third, never fewer than 3 for the longer stages
        _log(
            f"  stage {i + 1}: {len(alive)} candidates x {n_prompts} prompts x {n_tokens} tokens; "
            f"best {trials[0].score(objective):.3f} {objective}"
        )
        alive = [t.candidate for t in trials[:keep]]
    return trials


def tune(
    config_path: str, prompts_path: str, out_path: str, max_new_tokens: int = 128, objective: str = "tokens_per_s"
) -> Trial:
    if objective not in OBJECTIVES:
        raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    config = load_config(config_path)
    if not config.cascade.drafters:
        raise ValueError(f"{config_path}: no drafters to tune")
    engine = InProcess(config.cascade, tier_client=config.serving.tier_client)
    prompts = [engine.encode(p) for p in read_prompts(prompts_path)]
    costs = engine.swi_costs()
    _log("measuring lone-drafter acceptance (EWIF, Corollary 4.2):")
    drafters = [d.name for d in config.cascade.drafters]
    k_star = lone_drafter_k(engine, prompts[:2], costs["measured"])
    current = Candidate(
        tuple(map(tuple, config.cascade.schedule.to_lists())), config.cascade.leniency, config.cascade.lookup
    )
    statistical = [d.name for d in config.cascade.drafters if isinstance(d, StatisticalConfig)]
    grid = [current, *candidate_grid(drafters, k_star, statistical)]
    _log(f"halving grid search over {len(grid)} schedules, objective {objective}:")
    trials = halving_search(engine, grid, prompts, max_new_tokens, objective, costs)
    best = trials[0]
    _write_config(Path(config_path), Path(out_path), best, trials, objective, config.cascade.schedule.fill.name)
    _log(
        f"best: K = {[list(r) for r in best.candidate.k_matrix]}, leniency {best.candidate.leniency}, "
        f"lookup {_lookup_text(best.candidate.lookup)}: "
        f"{best.tokens_per_s:.1f} tok/s, SWI {best.swi_params:.2f} (params) / {best.swi_measured:.2f} (measured)"
    )
    return best


def _write_config(source: Path, out: Path, best: Trial, trials: list[Trial], objective: str, fill: str) -> None:
    raw = yaml.safe_load(source.read_text())
    for tier in [raw["tiers"]["target"], *raw["tiers"].get("drafters", [])]:
        for key in ("path", "bigram"):
            if isinstance(tier, dict) and isinstance(tier.get(key), str):
                tier[key] = _anchored(tier[key], source.parent)
    raw["schedule"] = {
        "k_matrix": [list(r) for r in best.candidate.k_matrix],
        "leniency": best.candidate.leniency,
        "fill": fill,  # the semantics the schedule was measured under (core.schedule)
    }
    if best.candidate.lookup is not None:
        raw["schedule"]["lookup"] = {
            "min_match": best.candidate.lookup.min_match,
            "tokens": best.candidate.lookup.tokens,
            "tier": best.candidate.lookup.tier,
        }
    lines = [f"# Tuned by `cascade-service tune` from {source} (objective {objective}); final stage:"]
    for t in trials:
        lines.append(
            f"#   K={[list(r) for r in t.candidate.k_matrix]} l={t.candidate.leniency} "
            f"lookup={_lookup_text(t.candidate.lookup)}: "
            f"{t.tokens_per_s:.1f} tok/s, SWI params {t.swi_params:.2f}, measured {t.swi_measured:.2f}, "
            f"tokens/target call {t.mean_accepted_length:.2f}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n" + yaml.safe_dump(raw, sort_keys=False))


def _lookup_text(lookup: Lookup | None) -> str:
    return "off" if lookup is None else f"{lookup.min_match}-gram/{lookup.tokens}"


def _anchored(path: str, base: Path) -> str:
    # ${CASCADE_SERVICE_HOME}, ~ and absolute paths stay as written; relative ones were relative to the
    # source config's folder and must stay valid from wherever the tuned config is written.
    return path if path.startswith(("/", "$", "~")) else str((base / path).resolve())


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
