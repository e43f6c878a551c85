"""How well a drafter agrees with its target on given prompts, measured as `distill`'s report does
(acceptance by draft position along the target's greedy continuations, agreement by context position),
without training anything: `cascade-service zoo acceptance --target DIR --drafter DIR --prompts SRC
[SRC ...]`, one JSON line per source.

For a drafter already made (shipped, distilled, or a family's own), on text of the user's choosing:
the check behind "the drafters agree where it matters" on code or prose a family never trained on.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..models.hf import load_tokenizer
from .distill import Settings, cut_report_prompts, load_model, measure, pad_id
from .distill_data import continue_prompts
from .train import threads


def acceptance(target_dir: Path, drafter_dir: Path, source: Path, settings: Settings | None = None) -> dict:
    """`distill`'s report figures for the drafter in `drafter_dir` under the target in `target_dir`, on
    REPORT_PROMPTS prompts cut from `source` as `distill --report-prompts` cuts them."""
    settings = settings or Settings()
    with threads(settings.threads):
        target = load_model(target_dir).eval()
        drafter = load_model(drafter_dir).eval()
        tokenizer = load_tokenizer(target_dir)
        prompts = cut_report_prompts(source, tokenizer, settings)
        with tempfile.TemporaryDirectory() as scratch:
            made = Path(scratch) / "held_out.jsonl"
            pad, tokens = pad_id(tokenizer), settings.continuation
            reference = list(continue_prompts(target, prompts, made, tokens, 0.0, pad, settings.seed))
        return {"prompts": str(source), "held_out_prompts": len(reference)} | measure(
            target, drafter, reference, settings.draft_k
        )


HELP = "how well a drafter agrees with its target on prompts of your choosing, as distill reports it, no training"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="the reviewing model's directory")
    parser.add_argument("--drafter", required=True, help="the drafter's directory")
    parser.add_argument("--prompts", required=True, nargs="+", help="JSON-lines files or folders, as distill's")
    parser.add_argument("--threads", type=int, default=Settings.threads)


def run(args: argparse.Namespace) -> int:
    settings = Settings(threads=args.threads)
    for source in args.prompts:
        report = acceptance(Path(args.target), Path(args.drafter), Path(source), settings)
        print(json.dumps(report), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.zoo.acceptance`: the same as `cascade-service zoo acceptance`."""
    parser = argparse.ArgumentParser(prog="python -m cascade_service.zoo.acceptance", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
