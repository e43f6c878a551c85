"""What one pass of each model tier of a config costs under each `graphs` mode (models.staticpass), side
by side in one run: one row, 1 and 4 new tokens (a step and a review of 3 drafts), at two context
lengths; medians of `repeats` passes after two warm-ups.

    cascade-service bench steps --config configs/demo.yaml [--modes off,eager] [--device cpu]

On the CPU this prices `graphs: eager` (the fixed shapes without capture) against the default; on cuda
`auto` (CUDA graphs) against `off`.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import torch

from ..config import ModelTierConfig, load_config
from ..engine.core import EngineCore
from ..models.hf import pass_time_s
from ..models.staticpass import WARM_ROWS
from . import tools

CONTEXTS = (64, 512)
TOKENS = (1, 4)


def step_table(tiers: Sequence[ModelTierConfig], modes: Sequence[str], device: str, repeats: int) -> str:
    lines = ["| tier | graphs | " + " | ".join(f"{t} tok @ {c}" for c in CONTEXTS for t in TOKENS) + " |"]
    lines.append("|---" * (2 + len(CONTEXTS) * len(TOKENS)) + "|")
    core = EngineCore(max_batch=WARM_ROWS)  # loads each as a server does: graphs captured before timing
    for tier in tiers:
        for mode in modes:
            model = core.model(tier, device=device, graphs=mode)
            timed = [functools.partial(pass_time_s, model, 1, c, repeats, tokens=t) for c in CONTEXTS for t in TOKENS]
            times = [core.loop.run(time) * 1e3 for time in timed]  # on the loop's thread, as it serves
            shown = " | ".join(f"{ms:.2f} ms" for ms in times)
            lines.append(f"| {tier.name} ({tier.backend}) | {mode} | {shown} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--modes", default="off,eager", help="graphs modes, comma-separated (auto, eager, off)")
    parser.add_argument("--device", default=None, help="every tier's device (default: the config's)")
    parser.add_argument("--repeats", type=int, default=15)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config).cascade
    tiers = [t for t in (config.target, *config.drafters) if isinstance(t, ModelTierConfig) and not t.remote]
    with torch.inference_mode():
        print(step_table(tiers, args.modes.split(","), args.device or tiers[0].device, args.repeats), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.steps`: the same as `cascade-service bench steps`."""
    return tools.main("steps", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
