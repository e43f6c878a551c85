"""Structured output: does every output follow its JSON schema, and what does the grammar cost?

    cascade-service bench structured [--config configs/demo.yaml] [--schemas 50]
        [--max-new-tokens 160] [--whitespace compact|spaced|free]

In process, greedy. `--schemas` JSON schemas generated here (objects of 1 to 4 properties drawn from
enums, bounded integers, booleans, short strings, short arrays and nested objects; the whitespace is
the request's: compact, the service's default, unless `--whitespace` says otherwise), each with a prompt
from code the zoo never trained on followed by a comment that asks for JSON. Per schema: the cascade
with the format, then without it for as many tokens; printed: how many outputs end within the budget
and how many parse and validate against their schema (the `jsonschema` package checks them), the median
tokens per second of each and their ratio, and the grammar's own time per output token (every mask,
the forced tokens and the matcher's steps, timed around core.grammar.GrammarMask).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from ..config import GenerationConfig, load_config
from ..core import grammar
from ..core.grammar import ResponseFormat
from ..inprocess import InProcess
from ..zoo.evaluate import eval_package_files
from . import tools


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--whitespace", choices=list(grammar.WHITESPACE), default=grammar.DEFAULT_WHITESPACE)


def run(args: argparse.Namespace) -> int:
    import jsonschema  # type: ignore[import-untyped]  # a checker for the benchmark, not the service's dependency

    engine = InProcess(load_config(args.config).cascade)
    spent = _time_the_grammar()
    prompts = _prompts(engine, args.schemas)
    valid, ended, ratios, overheads, lengths = 0, 0, [], [], []
    for i, schema in enumerate(schemas(args.schemas)):
        prompt = prompts[i % len(prompts)]
        spent[0] = 0.0
        fmt = ResponseFormat("json_schema", json.dumps(schema), args.whitespace)
        start = time.perf_counter()
        got = engine.generate(prompt, GenerationConfig(max_new_tokens=args.max_new_tokens, response_format=fmt))
        rate = len(got.token_ids) / (time.perf_counter() - start)
        ended += len(got.token_ids) < args.max_new_tokens  # the grammar ended it, not the budget
        # The same prompt, free, for as many tokens: a request's fixed costs (the prompt's prefill) weigh alike.
        start = time.perf_counter()
        free = engine.generate(prompt, GenerationConfig(max_new_tokens=max(1, len(got.token_ids))))
        free_rate = len(free.token_ids) / (time.perf_counter() - start)
        text = engine.decode_text(got.token_ids)
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            print(f"schema {i}: not valid ({type(exc).__name__}): {text[:80]!r}")
        ratios.append(rate / free_rate)
        overheads.append(spent[0] / max(1, len(got.token_ids)))
        lengths.append(len(got.token_ids))
    print(
        f"{ended}/{args.schemas} outputs ended within {args.max_new_tokens} tokens, {valid} valid; "
        f"tokens/s constrained / free: median {statistics.median(ratios):.2f}x "
        f"(min {min(ratios):.2f}x); grammar time per output token: median {1e3 * statistics.median(overheads):.3f} ms; "
        f"output tokens: median {statistics.median(lengths)}"
    )
    return 0


def schemas(count: int, seed: int = 0) -> list[dict]:
    """`count` distinct object schemas (their whitespace is the request's option, not the schema's)."""
    rng = random.Random(seed)
    kinds = [
        lambda: {"enum": rng.sample(["red", "green", "blue", "black", "white"], 3)},
        lambda: {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])},
        lambda: {"type": "boolean"},
        lambda: {"type": "string", "maxLength": rng.choice([4, 8, 12])},
        lambda: {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        lambda: {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["x"],
            "additionalProperties": False,
        },
    ]
    names = ["id", "name", "kind", "size", "ok", "tags", "level", "mode", "pos", "color"]
    out: list[dict] = []
    seen: set[str] = set()
    while len(out) < count:
        keys = rng.sample(names, rng.randint(1, 4))
        properties = {k: rng.choice(kinds)() for k in keys}
        schema = {
            "type": "object",
            "properties": properties,
            "required": keys,
            "additionalProperties": False,
        }
        text = json.dumps(schema, sort_keys=True)
        if text not in seen:
            seen.add(text)
            out.append(schema)
    return out


def _prompts(engine: InProcess, count: int) -> list[list[int]]:
    out = []
    for paths in eval_package_files().values():
        for path in paths:
            ids = engine.encode(Path(path).read_text(errors="replace"))
            if len(ids) > 400:
                out.append(ids[200:360] + engine.encode("\n# The settings, as one JSON object:\n"))
            if len(out) == count:
                return out
    return out


def _time_the_grammar() -> list[float]:
    """Seconds spent in GrammarMask's masks and steps since the counter was last reset (its [0])."""
    spent = [0.0]
    for name in ("masks", "forced", "advance"):  # `mask`, a drafter's step, goes through `masks`
        original = getattr(grammar.GrammarMask, name)

        def timed(self, *args, _original=original):
            start = time.perf_counter()
            try:
                return _original(self, *args)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(grammar.GrammarMask, name, timed)
    return spent


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.structured`: the same as `cascade-service bench structured`."""
    return tools.main("structured", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
