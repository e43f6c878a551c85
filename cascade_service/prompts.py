"""Prompt files: JSON lines of {"prompt": "..."} objects, as `bench` and `tune` read them."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompts(path: str) -> list[str]:
    """Prompts from a JSON-lines file of {"prompt": "..."} objects (blank lines skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--prompts: cannot read {path}: {exc.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--prompts {path} line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ValueError(f'--prompts {path} line {number}: expected {{"prompt": "<non-empty text>"}}')
        prompts.append(item["prompt"])
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts")
    return prompts
