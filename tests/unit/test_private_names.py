"""No module calls another module's private names (issue 47): a name that starts with `_` is its own
module's business. What crosses modules is public and says so; a file split by concept, not to stay
under the line cap, keeps each concept's privates inside it."""

from __future__ import annotations

import ast

import pytest

from tests.unit.imports import sources

# Underscored names of other libraries that are their public API: namedtuple's methods, argparse's
# subparsers type, os._exit (a child's exit without cleanup), and prometheus_client's value holder,
# which has no public reader.
FOREIGN = {"_replace", "_asdict", "_fields", "_SubParsersAction", "_exit", "_value"}


def _own_names(tree: ast.AST) -> set[str]:
    """The underscored names a module defines: its functions, classes, assignments and attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {name for name in names if name.startswith("_")}


def private_uses(rel: str, source: str) -> list[str]:
    """Another module's private names that `source` imports or reads."""
    tree = ast.parse(source, filename=rel)
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [
                f"{rel}:{node.lineno} imports {alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            ]
        elif isinstance(node, ast.Attribute):
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in own | FOREIGN:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"{rel}:{node.lineno} reads {ast.unparse(node)}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = [use for rel, source in sources().items() for use in private_uses(rel, source)]
    assert not found, found


@pytest.mark.parametrize(
    "source",
    [
        "from .batching import _take\n",
        "def f(batcher):\n    return batcher._run([])\n",  # a private method of another module's class
        "def f(loop):\n    loop._park(('pass',))\n",
    ],
)
def test_the_check_finds_a_private_name_used_across_modules(source):
    # The negative control: the calls issue 47 found (loop._park, batcher._run, batcher._take).
    assert private_uses("scheduling/loop.py", source)


def test_a_modules_own_privates_are_its_own():
    own = "class A:\n    def __init__(self):\n        self._n = 0\n\ndef f(a: A):\n    return a._n\n"
    assert private_uses("core/x.py", own) == []
