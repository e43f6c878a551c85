"""Which grammar engine: llguidance (the one core.grammar uses), xgrammar and outlines-core, side by side.

    pip install xgrammar apache-tvm-ffi outlines-core   # not dependencies: only this comparison needs them
    cascade-service bench grammar-engines [--config configs/demo.yaml] [--schemas 50]

On bench.structured's generated JSON schemas and the config's target tokenizer: each engine's time to
compile a schema (to a matcher whose first mask is computed), and its time per token to compute a mask
and take the token, along one valid output per schema (a random walk under llguidance's masks, compact
JSON). outlines-core's vocabulary is built from the tokenizer's strings; an output its regex refuses
is counted, and its time is over the tokens it took.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..config import load_config
from ..core.grammar import WHITESPACE
from . import tools
from .structured import schemas


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--schemas", type=int, default=50)


def run(args: argparse.Namespace) -> int:
    import llguidance
    import llguidance.hf
    import xgrammar as xgr  # type: ignore[import-not-found]
    from outlines_core import Guide, Index, Vocabulary  # type: ignore[import-not-found]
    from outlines_core.json_schema import build_regex_from_schema  # type: ignore[import-not-found]
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(load_config(args.config).cascade.target.path)
    size = len(tok)
    llg_tokenizer = llguidance.hf.from_tokenizer(tok)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=size), cache_enabled=False)
    strings: dict[str, list[int]] = {}
    for token, i in tok.get_vocab().items():
        if i != tok.eos_token_id:
            strings.setdefault(tok.convert_tokens_to_string([token]), []).append(i)
    vocabulary = Vocabulary(tok.eos_token_id, strings)
    times: dict[str, tuple[list[float], list[float]]] = {
        k: ([], []) for k in ("llguidance", "xgrammar", "outlines-core")
    }
    refused, rng = 0, random.Random(0)
    for schema in schemas(args.schemas):
        text = json.dumps(schema)
        start = time.perf_counter()
        # Compact, as xgrammar's below (any_whitespace=False): the same language for both
        compact: Any = WHITESPACE["compact"]  # llguidance's JsonCompileOptions (a TypedDict)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=compact)
        matcher = llguidance.LLMatcher(llg_tokenizer, grammar)
        matcher.compute_bitmask()
        times["llguidance"][0].append(time.perf_counter() - start)
        walk = _walk(matcher, size, rng)
        matcher = llguidance.LLMatcher(llg_tokenizer, grammar)
        times["llguidance"][1].append(_per_token(walk, lambda t, m=matcher: (m.compute_bitmask(), m.consume_token(t))))
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(text, any_whitespace=False)
        xm, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, size)
        xm.fill_next_token_bitmask(bitmask)
        times["xgrammar"][0].append(time.perf_counter() - start)
        xm = xgr.GrammarMatcher(compiled)
        times["xgrammar"][1].append(
            _per_token(walk, lambda t, m=xm, b=bitmask: (m.fill_next_token_bitmask(b), m.accept_token(t)))
        )
        start = time.perf_counter()
        index = Index(build_regex_from_schema(text), vocabulary)
        Guide(index).get_tokens()
        times["outlines-core"][0].append(time.perf_counter() - start)
        guide = Guide(index)
        try:
            times["outlines-core"][1].append(_per_token(walk, lambda t, g=guide: (g.get_tokens(), g.advance(t))))
        except ValueError:
            refused += 1
    for name, (compile_s, token_s) in times.items():
        print(
            f"{name}: compile median {1e3 * statistics.median(compile_s):.1f} ms (max {1e3 * max(compile_s):.1f}); "
            f"per token median {1e3 * statistics.median(token_s):.3f} ms (max {1e3 * max(token_s):.3f})"
        )
    print(f"outlines-core refused {refused} of {args.schemas} valid outputs")
    return 0


def _walk(matcher: Any, size: int, rng: random.Random, limit: int = 80) -> list[int]:
    """One valid output: a random allowed token at each step, until the grammar ends."""
    walk: list[int] = []
    while len(walk) < limit and not matcher.is_stopped():
        bits = np.unpackbits(np.frombuffer(bytes(matcher.compute_bitmask()), dtype=np.uint8), bitorder="little")
        allowed = np.nonzero(bits[:size])[0]
        if not len(allowed):
            break
        walk.append(int(rng.choice(list(allowed))))
        matcher.consume_token(walk[-1])
    return walk


def _per_token(walk: list[int], step: Any) -> float:
    start = time.perf_counter()
    for token in walk:
        step(token)
    return (time.perf_counter() - start) / max(1, len(walk))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.grammar_engines`: the same as `cascade-service bench grammar-engines`."""
    return tools.main("grammar_engines", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
