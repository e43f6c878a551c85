"""Predicted outputs: how much faster a request decodes when the client sends the output it expects.

    cascade-service bench prediction [--config configs/demo.yaml] [--prompts 6]
        [--prompt-tokens 200] [--new-tokens 256] [--edit-share 0.05] [--repeats 3]

In process, greedy, on code the zoo never trained on (the installed click, jinja2, packaging and tqdm
sources: `zoo.evaluate`): each prompt is a window of one file. Per prompt, three conditions, interleaved
within each repeat: no prediction; the exact output as a prediction (its text, tokenized afresh as a
client's text is: the upper bound, a client that knows the answer); and that text with `--edit-share`
of its lines changed (an edit of a file: a line replaced by another line of the output, or by a
comment). Printed per prompt: the median tokens per second of each condition and its ratio to no
prediction, target passes, and the prediction's accepted and rejected tokens; every output must be the
one without a prediction, or the run stops.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from ..config import GenerationConfig, load_config
from ..core.proposers.prediction import PREDICTION, prediction_ids
from ..inprocess import InProcess
from ..zoo.evaluate import eval_package_files
from . import tools

CONDITIONS = ("none", "exact", "edited")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--edit-share", type=float, default=0.05, help="share of the output's lines changed")
    parser.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    engine = InProcess(load_config(args.config).cascade)
    plain = GenerationConfig(max_new_tokens=args.new_tokens)
    ratios: dict[str, list[float]] = {c: [] for c in CONDITIONS[1:]}
    print(
        "prompt | tok/s none | exact (x) | edited (x) | target passes none/exact/edited | kept/rejected exact, edited"
    )
    for i, prompt in enumerate(encoded_prompts(engine, args.prompts, args.prompt_tokens)):
        reference = engine.generate(prompt, plain)  # warms the caches too
        text = engine.decode_text(reference.token_ids)
        edited = _edit(text, args.edit_share, random.Random(i))
        gens = {
            "none": plain,
            "exact": GenerationConfig(max_new_tokens=args.new_tokens, prediction=prediction_ids(engine.encode, text)),
            "edited": GenerationConfig(
                max_new_tokens=args.new_tokens, prediction=prediction_ids(engine.encode, edited)
            ),
        }
        rates: dict[str, list[float]] = {c: [] for c in CONDITIONS}
        last = {}
        for _ in range(args.repeats):
            for condition in CONDITIONS:
                start = time.perf_counter()
                result = engine.generate(prompt, gens[condition])
                rates[condition].append(len(result.token_ids) / (time.perf_counter() - start))
                if result.token_ids != reference.token_ids:
                    raise SystemExit(f"prompt {i}, {condition}: the output changed; the prediction must not change it")
                last[condition] = result.stats
        median = {c: statistics.median(r) for c, r in rates.items()}
        for c in ratios:
            ratios[c].append(median[c] / median["none"])
        passes = "/".join(str(last[c].target_calls) for c in CONDITIONS)
        kept = ", ".join(_counts(last[c]) for c in CONDITIONS[1:])
        print(
            f"{i} | {median['none']:.1f} | {median['exact']:.1f} ({median['exact'] / median['none']:.2f}x) | "
            f"{median['edited']:.1f} ({median['edited'] / median['none']:.2f}x) | {passes} | {kept}"
        )
    print(
        f"median over prompts: exact {statistics.median(ratios['exact']):.2f}x, "
        f"edited ({args.edit_share:.0%} of lines) {statistics.median(ratios['edited']):.2f}x; every output identical"
    )
    return 0


def encoded_prompts(engine: InProcess, count: int, tokens: int) -> list[list[int]]:
    """`count` windows of `tokens` tokens, each from its own held-out file (its middle)."""
    out = []
    for paths in eval_package_files().values():
        for path in paths:
            ids = engine.encode(Path(path).read_text(errors="replace"))
            if len(ids) >= 3 * tokens:
                out.append(ids[len(ids) // 2 - tokens : len(ids) // 2])
            if len(out) == count:
                return out
    raise SystemExit(f"not enough held-out files for {count} prompts of {tokens} tokens")


def _edit(text: str, share: float, rng: random.Random) -> str:
    """`text` with `share` of its lines (at least one) replaced by another of its lines or a comment."""
    lines = text.split("\n")
    for i in rng.sample(range(len(lines)), max(1, round(share * len(lines)))):
        lines[i] = rng.choice([rng.choice(lines), lines[i].split("#")[0] + "# changed"])
    return "\n".join(lines)


def _counts(stats) -> str:
    review = stats.reviews.get(stats.target)
    accepted, rejected = review.kept(PREDICTION) if review is not None else (0, 0)
    return f"{accepted}/{rejected}"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.prediction`: the same as `cascade-service bench prediction`."""
    return tools.main("prediction", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
