"""Prompt sets that ship with the benchmarks, and how the one where drafts disagree was made.

`disagree.jsonl`: long openings of Python modules from third-party packages the shipped family never
trained on (its corpus is the standard library's sources and, for its long-context stage, other
installed packages, none of these: zoo/lengthen.py; the shipped weights' stage also read fastapi and
jsonschema, which are written against starlette, anyio and attrs, and which zoo/judged.py now refuses)
and that no benchmark or tuning prompt of the family comes from (those are click, jinja2, packaging
and tqdm, and held-out stdlib modules). Every line names its package in "source": the builders read it
(zoo.judged) to keep each package a prompt set is cut from, and every package depending on one, out
of training. Each prompt is 400-700 tokens, cut at a line boundary inside the module: the context
lengths users send, on code in a style the family did not learn. The drafters of the family trained
on 256-token windows parted from it there (first-position acceptance about 0.2 where it was 0.6 on its
own prompts); that is what a floor under the speedup was first judged on.
Never used to tune anything.

Rebuild (the same packages installed; the file is committed, so every machine benchmarks the same text):
    cascade-service bench prompt-sets --out cascade_service/bench/prompts/disagree.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from ..zoo.judged import PROMPTS_DIR, SOURCES
from . import tools

# The shipped prompt sets' folder and the sources disagree.jsonl is cut from live with the list of judged
# code (zoo/judged.py), which the zoo's builders check their training packages against.
DISAGREE = PROMPTS_DIR / "disagree.jsonl"
MIN_TOKENS, MAX_TOKENS = 400, 700


def cut_prompt(source: str, count_tokens: Callable[[str], int], skip_lines: int, most: int) -> str | None:
    """The longest run of whole lines of `source` from `skip_lines` on that counts at most `most`
    tokens, ending on a non-blank indented line (inside a function, so there is code left to write);
    None if no such run reaches MIN_TOKENS."""
    lines = source.splitlines(keepends=True)[skip_lines:]
    best = None
    for end in range(1, len(lines) + 1):
        text = "".join(lines[:end])
        n = count_tokens(text)
        if n > most:
            break
        last = lines[end - 1]
        if n >= MIN_TOKENS and last.strip() and last.startswith((" ", "\t")):
            best = text
    return best


def build(count_tokens: Callable[[str], int], sources: Sequence[tuple[str, str]] = SOURCES) -> list[dict]:
    """One prompt per (package, module): the module's text after its first third (past the imports and
    the module docstring), cut by `cut_prompt` at lengths spread evenly over MIN_TOKENS..MAX_TOKENS."""
    from ..zoo.judged import distribution_version

    prompts = []
    for i, (package, module) in enumerate(sources):
        most = MIN_TOKENS + (MAX_TOKENS - MIN_TOKENS) * (i % 4 + 1) // 4
        root = Path(importlib.import_module(package).__file__ or "").parent
        text = (root / module).read_text()
        skip = len(text.splitlines()) // 3
        prompt = cut_prompt(text, count_tokens, skip, most)
        if prompt is None:
            raise ValueError(f"{package}/{module}: no run of {MIN_TOKENS}-{MAX_TOKENS} tokens")
        version = distribution_version(package)  # its distribution's (yaml: PyYAML's)
        prompts.append({"prompt": prompt, "source": f"{package} {version}: {module}", "tokens": count_tokens(prompt)})
    return prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(DISAGREE))


def run(args: argparse.Namespace) -> int:
    from ..models.hf import load_tokenizer
    from ..zoo.shipped import shipped_zoo

    tokenizer = load_tokenizer(shipped_zoo()["large"])
    prompts = build(lambda text: len(tokenizer(text).input_ids))
    Path(args.out).write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts, {min(p['tokens'] for p in prompts)}-{max(p['tokens'] for p in prompts)} tokens")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.prompt_sets`: the same as `cascade-service bench prompt-sets`."""
    return tools.main("prompt_sets", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
