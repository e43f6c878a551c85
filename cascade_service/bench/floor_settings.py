"""The floor's settings side by side: `cascade-service bench floor-settings`.

Each variant of `FloorSettings` gets a coordinator of its own (its own evidence) over one engine, and
every prompt runs under each in turn, beside `ar` (the target alone) and the K-matrix every round, in
one process: tokens/s over `ar` as the median of the repeats' ratios, and the share of rounds that
drafted. What docs/benchmarks.md "A floor under the speedup" chose the defaults by.

    cascade-service bench floor-settings --config configs/demo.yaml --prompts P \\
        --variants '{"defaults": {}, "tight": {"epsilon": 0.01, "credit": 1.0}}' [--temperature 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

from ..config import GenerationConfig, load_config
from ..engine.policies import floor_policies
from ..engine.policies.floor import FloorSettings
from ..inprocess import InProcess
from ..prompts import read_prompts
from ..sessions import MemoryStore
from . import tools


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--variants", default='{"defaults": {}}', help="JSON: name -> FloorSettings fields")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    engine = InProcess(load_config(args.config).cascade)
    prompts = [engine.encode(p) for p in read_prompts(args.prompts)]
    runs = {
        "ar": (engine.variant([]).coordinator(MemoryStore()), "fixed"),
        "fixed": (engine.coordinator(MemoryStore(), leaves=engine.leaves), "fixed"),
    }
    for name, fields in json.loads(args.variants).items():
        coordinator = engine.coordinator(MemoryStore(), leaves=engine.leaves, floor=False)
        coordinator.policies = floor_policies(None, FloorSettings(**fields))
        runs[name] = (coordinator, "auto")
    speed: dict[str, list[float]] = {name: [] for name in runs}
    drafted = dict.fromkeys(runs, 0)
    rounds = dict.fromkeys(runs, 0)
    for repeat in range(args.repeats):
        tokens, seconds = dict.fromkeys(runs, 0), dict.fromkeys(runs, 0.0)
        for i, prompt in enumerate(prompts):
            for name, (coordinator, speculation) in runs.items():  # interleaved: drift hits all alike
                gen = GenerationConfig(
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    seed=repeat * len(prompts) + i,
                    speculation=speculation,
                )
                began = time.perf_counter()
                chunk = engine.loop.run(coordinator.generate, coordinator.request(prompt, gen))
                seconds[name] += time.perf_counter() - began
                tokens[name] += len(chunk.token_ids)
                assert chunk.stats is not None
                drafted[name] += chunk.stats.drafted_rounds
                rounds[name] += chunk.stats.target_calls
        for name in runs:
            speed[name].append(tokens[name] / seconds[name])
    for name in runs:
        ratio = statistics.median(s / a for s, a in zip(speed[name], speed["ar"]))
        print(
            f"{name:>12}: {statistics.median(speed[name]):7.1f} tok/s, {ratio:.3f}x ar, "
            f"rounds that drafted {drafted[name] / max(rounds[name], 1):.0%}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.floor_settings`: the same as `cascade-service bench floor-settings`."""
    return tools.main("floor_settings", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
