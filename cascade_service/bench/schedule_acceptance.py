"""What the engine accepts under a config's schedule, beside the proxy `distill` and `zoo acceptance` report.

    cascade-service bench schedule-acceptance --config configs/demo.yaml --prompts HELD.jsonl \
        [--max-new-tokens 64] [--temperatures 0,1] [--proxy]

`distill` and `zoo acceptance` score a drafter as a greedy autoregressive drafter under one reviewer
(acceptance by draft position along the reviewer's greedy continuations). In a schedule a drafter does
other work: base reviews small's and MaG's drafts leniently and drafts for large only what survives,
MaG drafts point masses, a sampled request's drafts are kept when their races agree. This runs the
config's cascade with the K-matrix every round (speculation "fixed": not the floor's choices) over
the prompts, greedy and at each temperature, and prints per temperature the tokens per target call
and, per reviewing tier, the share of each drafter's drafts it kept; with `--proxy`, the proxy's
first-position acceptance of each model drafter under the tier above it on the same prompts beside
it (one JSON object per line).
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from ..config import GenerationConfig, ModelTierConfig, load_config
from ..inprocess import InProcess
from ..prompts import read_prompts
from . import tools


def engine_acceptance(engine: InProcess, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> dict:
    """Tokens per target call and each reviewer's kept share per drafter, summed over `prompts`."""
    generated = calls = 0
    drafted: dict[str, Counter] = {}
    accepted: dict[str, Counter] = {}
    for i, prompt in enumerate(prompts):
        gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=i, speculation="fixed")
        stats = engine.generate(prompt, gen).stats.to_dict()
        generated += stats["generated_tokens"]
        calls += stats["target_calls"]
        for reviewer, review in stats["reviews"].items():
            drafted.setdefault(reviewer, Counter()).update(review["drafted_by_drafter"])
            accepted.setdefault(reviewer, Counter()).update(review["accepted_by_drafter"])
    kept = {
        reviewer: {
            drafter: {"drafted": n, "kept": round(accepted[reviewer][drafter] / n, 4)}
            for drafter, n in sorted(counts.items())
            if n
        }
        for reviewer, counts in drafted.items()
    }
    return {
        "temperature": temperature,
        "tokens_per_target_call": round(generated / calls, 4) if calls else 0.0,
        "generated": generated,
        "target_calls": calls,
        "kept_by_reviewer": kept,
    }


def proxy(config_path: str, prompts_path: str) -> dict[str, float]:
    """The proxy's first-position acceptance of each model drafter under the model tier above it."""
    from ..zoo.acceptance import acceptance

    cascade = load_config(config_path).cascade
    models = [t for t in cascade.tiers if isinstance(t, ModelTierConfig)]
    found = {}
    for above, below in itertools.pairwise(models):
        report = acceptance(Path(above.path), Path(below.path), Path(prompts_path))
        found[f"{below.name} under {above.name}"] = report["acceptance_by_position"][0]
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the cascade config whose schedule runs")
    parser.add_argument("--prompts", required=True, help='JSON lines of {"prompt": ...}: text the family never saw')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", default="0,1", help="comma-separated; 0 is greedy")
    parser.add_argument("--proxy", action="store_true", help="also the proxy distill reports, on the same prompts")


def run(args: argparse.Namespace) -> int:
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if any(t < 0 for t in temperatures):
        raise ValueError(f"--temperatures must be >= 0, got {args.temperatures!r}")
    engine = InProcess(load_config(args.config).cascade)
    try:
        prompts = [engine.encode(text) for text in read_prompts(args.prompts)]
        for temperature in temperatures:
            print(json.dumps(engine_acceptance(engine, prompts, args.max_new_tokens, temperature)), flush=True)
    finally:
        engine.core.close()
    if args.proxy:
        print(json.dumps({"proxy_first_position_acceptance": proxy(args.config, args.prompts)}), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.schedule_acceptance`: `cascade-service bench schedule-acceptance`."""
    return tools.main("schedule-acceptance", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
