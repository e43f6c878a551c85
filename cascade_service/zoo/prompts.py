"""Held-out prompts for the demo zoo: openings of documented functions from modules the zoo never trains on."""

from __future__ import annotations

import ast
import json
import textwrap
from collections.abc import Sequence
from pathlib import Path

_PROMPT_LINES = (2, 4, 80)  # body lines after the docstring (min), lines left to continue (min), lines (max)


def extract_prompts(sources: Sequence[str], tokenizer, count: int, max_tokens: int) -> list[str]:
    """`count` function openings (def line, docstring, the first body lines), evenly spread over all
    documented functions in `sources`, each at most `max_tokens` tokens and with code left to write."""
    candidates: list[str] = []
    for source in sources:
        lines = source.splitlines(keepends=True)
        nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(nodes, key=lambda n: n.lineno):
            prompt = _function_opening(node, lines, tokenizer, max_tokens)
            if prompt is not None and prompt not in candidates:
                candidates.append(prompt)
    if len(candidates) < count:
        raise ValueError(f"only {len(candidates)} usable functions in the held-out sources, need {count}")
    return [candidates[i * len(candidates) // count] for i in range(count)]


def _function_opening(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str], tokenizer, max_tokens: int):
    min_body, min_left, max_lines = _PROMPT_LINES
    if ast.get_docstring(node) is None or len(node.body) < 2:
        return None
    body = lines[node.lineno - 1 : node.end_lineno]  # from the def line (decorators excluded)
    shortest = (node.body[0].end_lineno or node.lineno) - node.lineno + 1 + min_body
    best = None
    for n in range(shortest, min(len(body) - min_left, max_lines) + 1):
        text = textwrap.dedent("".join(body[:n]))
        if len(tokenizer(text).input_ids) > max_tokens:
            break
        best = text
    return best


def write_prompts(path: Path, prompts: Sequence[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
