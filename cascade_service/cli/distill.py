"""`cascade-service distill`: its arguments and its run (the training itself is zoo.distill)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from ..zoo.distill import DIVERGENCES, Settings, distill, parse_size

DEFAULTS = Settings()


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="the model directory of the tier that reviews the drafter")
    parser.add_argument(
        "--prompts",
        required=True,
        help='a JSON-lines file of {"prompt": ...} or a folder of text/code files, cut into prompts',
    )
    parser.add_argument(
        "--report-prompts",
        help="where the report's held-out prompts come from (a file or folder as --prompts; default: whole "
        "packages of --prompts held out of training, each folder directly under it a package)",
    )
    start = parser.add_mutually_exclusive_group(required=True)
    start.add_argument("--drafter", help="a model directory to start from (the target's vocabulary)")
    start.add_argument("--size", help="a new Llama drafter: base, small or HIDDEN:LAYERS")
    parser.add_argument("--out", required=True, help="the drafter's directory (a normal model directory)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument("--divergence", choices=sorted(DIVERGENCES), default=DEFAULTS.divergence)
    parser.add_argument("--steps", type=_positive(int), default=DEFAULTS.steps, help="optimizer steps")
    parser.add_argument("--batch", type=_positive(int), default=DEFAULTS.batch, help="sequences per step")
    parser.add_argument("--lr", type=_positive(float), default=DEFAULTS.lr, help="peak learning rate")
    parser.add_argument(
        "--prompts-count", type=_positive(int), default=DEFAULTS.prompts, help="training prompts to cut"
    )
    parser.add_argument(
        "--continuation", type=_positive(int), default=DEFAULTS.continuation, help="tokens the target adds to each"
    )
    parser.add_argument("--min-prompt-tokens", type=_positive(int), default=DEFAULTS.min_prompt_tokens)
    parser.add_argument("--max-prompt-tokens", type=_positive(int), default=DEFAULTS.max_prompt_tokens)
    parser.add_argument("--sampled", type=_share, default=DEFAULTS.sampled, help="share of sampled continuations")
    parser.add_argument(
        "--held-out", type=_share, default=DEFAULTS.held_out, help="share of --prompts' texts held out, whole packages"
    )
    parser.add_argument("--checkpoint-every", type=_positive(int), default=DEFAULTS.checkpoint_every)
    parser.add_argument("--threads", type=_positive(int), default=DEFAULTS.threads)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)


def run(args: argparse.Namespace) -> int:
    """Distill a drafter; prints the report's before/after figures as JSON, the drafter's directory on stderr."""
    if args.size is not None:
        parse_size(args.size)  # a bad size is a usage error before any model loads
    if args.min_prompt_tokens > args.max_prompt_tokens:
        raise ValueError(f"--min-prompt-tokens {args.min_prompt_tokens} is above --max-prompt-tokens")
    out = Path(args.out).expanduser()
    if out.exists() and any(out.iterdir()) and not args.resume and not (out / ".distill").is_dir():
        raise ValueError(f"--out {out}: exists and is not a distill run's directory; give another")
    known = {f.name for f in fields(Settings)}
    values = {k: v for k, v in vars(args).items() if k in known} | {"prompts": args.prompts_count}
    report = distill(
        Path(args.target).expanduser(),
        Path(args.prompts).expanduser(),
        out,
        start=Path(args.drafter).expanduser() if args.drafter else None,
        size=args.size,
        settings=Settings(**values),
        resume=args.resume,
        report_source=Path(args.report_prompts).expanduser() if args.report_prompts else None,
    )
    shown = {key: report[key] for key in ("before", "after", "steps", "seconds", "peak_rss_mb")}
    print(json.dumps(shown, indent=1))
    print(f"drafter written to {out}", file=sys.stderr)
    return 0
