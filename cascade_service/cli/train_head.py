"""`cascade-service train-head`: its arguments and its run (the training itself is zoo.train_head)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..core.request import check_temperature
from ..zoo.train_head import RUN_PRESETS, train_head


def _bounded(kind: type, low: float, high: float = math.inf):
    def parse(text: str):
        value = kind(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {text}")
        return value

    return parse


def _temperature(text: str) -> float:
    try:
        return check_temperature(float(text))  # the request's own rule: the head serves such requests
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("temperature ")) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `cascade-service train-head`."""
    parser.add_argument(
        "--preset", default="demo", choices=sorted(RUN_PRESETS), help="which family (shipped, or made if missing)"
    )
    parser.add_argument("--drafter", default="small", choices=["small", "base"], help="the zoo drafter it is for")
    parser.add_argument(
        "--reviewer",
        default="large",
        choices=["large", "base"],
        help="the tier whose acceptance the head predicts: the one that reviews this drafter's "
        "tokens in the cascade it will serve (base only for small)",
    )
    parser.add_argument(
        "--out",
        help="output directory (default: <zoo>/head-<drafter>, or "
        "<zoo>/head-<drafter>-under-base with --reviewer base)",
    )
    parser.add_argument("--steps", type=_bounded(int, 1), help="optimizer steps (default: per preset)")
    parser.add_argument("--depth", type=_bounded(int, 0, 64), default=3, help="residual blocks D (paper: 3)")
    parser.add_argument(
        "--w-rej",
        type=_bounded(float, 1e-6),
        default=6.0,
        help="BCE weight of rejections (paper: 6, paired with threshold h = 0.7)",
    )
    parser.add_argument(
        "--temperature",
        type=_temperature,
        default=1.0,
        help="temperature of responses and labels: the serving one (0 = greedy; paper: 1)",
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Train a head on a zoo (built first if missing); prints the summary as JSON on stdout."""
    from cascade_service.cli.parser import UsageError
    from cascade_service.paths import zoo_dir
    from cascade_service.zoo.build import training_texts
    from cascade_service.zoo.families import family

    if args.reviewer == "base" and args.drafter != "small":
        raise UsageError(f"--reviewer base reviews only small, not {args.drafter!r}")
    paths = family(args.preset)
    corpus_chars = json.loads(paths["report"].read_text())["spec"].get("corpus_chars")  # its corpus, its split
    sizes = RUN_PRESETS[args.preset] | ({"steps": args.steps} if args.steps is not None else {})
    default = f"head-{args.drafter}" + ("" if args.reviewer == "large" else f"-under-{args.reviewer}")
    out = Path(args.out).expanduser() if args.out else zoo_dir(args.preset) / default
    texts = training_texts(corpus_chars, progress=False)  # never the held-out modules
    # The reviewer plays the paper's target: it writes the responses and its distribution labels them.
    summary = train_head(
        paths[args.reviewer],
        paths[args.drafter],
        out,
        texts=texts,
        depth=args.depth,
        w_rej=args.w_rej,
        temperature=args.temperature,
        seed=args.seed,
        progress=True,
        **sizes,
    )
    print(json.dumps(summary, indent=1))
    print(f"head written to {out}", file=sys.stderr)
    return 0
