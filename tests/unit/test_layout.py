"""The layout stays readable: no Python file over 400 lines (generated stubs aside), and tests share
helpers through tests/helpers/ (or fixtures), never by importing from another test module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400


def _sources():
    for folder in ("cascade_service", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not any(g in path.relative_to(ROOT).as_posix() for g in ("proto/v1/", "proto/tier/v1/")):
                yield path


def test_no_python_file_is_over_400_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_no_test_module_imports_another():
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                last = node.module.split(".")[-1]
                assert not last.startswith("test_"), (
                    f"{path.relative_to(ROOT)} imports from test module {node.module}; share it through tests/helpers"
                )
