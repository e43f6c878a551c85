"""What keyed draws cost in acceptance: the Gumbel coupling against speculative sampling's maximal one.

    cascade-service bench coupling --config configs/demo.yaml \
        --prompts cascade_service/bench/prompts/disagree.jsonl [--temperatures 0.7,1] [--positions 256] [--draws 128]

A lossless sampled request draws each position's token as the race winner under noise keyed by (seed,
position) (core.sampling `race`), so a seed fixes its output whatever was drafted; a draft is kept
when the drafter's race goes the same way as the target's. Speculative sampling from a call's
generator keeps a draft with probability 1 - TV(p, q), the most any coupling can; the race keeps it with
P(argmax p/E = argmax q/E), which is less. For each model drafter of the config this prints both, per
temperature, averaged over the positions of the prompts (teacher-forced: every position's target and
drafter distributions from one forward pass of each model over the prompt), the race's by Monte Carlo
over `draws` noise draws a position. A point-mass drafter (MaG, suffix) is kept with probability p(x)
under both, so it is not listed.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import torch

from ..config import ModelTierConfig, load_config
from ..core.sampling import SamplingParams
from ..engine.core import EngineCore
from ..models.hf import HFModel, load_tokenizer
from ..prompts import read_prompts
from . import tools


def agreement(p: torch.Tensor, q: torch.Tensor, draws: int, generator: torch.Generator) -> tuple[float, float]:
    """([n, V] target, [n, V] drafter) -> (mean 1 - TV, mean race agreement over `draws` noises a row)."""
    maximal = float(torch.minimum(p, q).sum(-1).mean())
    agree = []
    for i in range(len(p)):
        noise = torch.empty(draws, p.shape[-1]).exponential_(generator=generator)
        agree.append(float(((p[i] / noise).argmax(-1) == (q[i] / noise).argmax(-1)).float().mean()))
    return maximal, statistics.fmean(agree)


def measure(
    target: HFModel, drafter: HFModel, prompts: list[list[int]], temperature: float, draws: int
) -> tuple[float, float, int]:
    """(1 - TV, race agreement, positions) of `drafter` against `target` at `temperature` over `prompts`."""
    sampling = SamplingParams(temperature)
    generator = torch.Generator().manual_seed(0)
    maximal, race, weights = [], [], []
    for prompt in prompts:
        p = sampling.probs(target.full_logits(prompt)).cpu()
        q = sampling.probs(drafter.full_logits(prompt)).cpu()
        m, r = agreement(p, q, draws, generator)
        maximal.append(m * len(prompt))
        race.append(r * len(prompt))
        weights.append(len(prompt))
    total = sum(weights)
    return sum(maximal) / total, sum(race) / total, total


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a cascade config (its target and model drafters)")
    parser.add_argument("--prompts", required=True, help='JSON lines of {"prompt": ...}, text the family never saw')
    parser.add_argument("--temperatures", default="0.7,1", help="comma-separated temperatures (> 0)")
    parser.add_argument("--positions", type=int, default=256, help="positions read from each prompt (its first)")
    parser.add_argument("--draws", type=int, default=128, help="noise draws a position for the race's agreement")


def run(args: argparse.Namespace) -> int:
    temperatures = [float(t) for t in args.temperatures.split(",")]
    config = load_config(args.config).cascade
    tokenizer = load_tokenizer(config.target.path)
    prompts = [tokenizer.encode(text)[: args.positions] for text in read_prompts(args.prompts)]
    core = EngineCore()
    try:

        def load(tier: ModelTierConfig) -> HFModel:
            model = core.model(tier)
            assert isinstance(model, HFModel), f"{tier.name}: a transformers model"
            return model

        target = load(config.target)
        for tier in config.drafters:
            if not isinstance(tier, ModelTierConfig):
                continue
            drafter = load(tier)
            for temperature in temperatures:
                maximal, race, n = core.loop.run(measure, target, drafter, prompts, temperature, args.draws)
                print(
                    f"{tier.name} drafting for {config.target.name} at T = {temperature:g} over {n} positions: "
                    f"speculative sampling keeps {maximal:.3f} (1 - TV), the keyed race {race:.3f} "
                    f"({race / maximal:.2f}x)"
                )
    finally:
        core.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.coupling`: the same as `cascade-service bench coupling`."""
    return tools.main("coupling", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
