"""No module calls another module's private names (issue 47): a name that starts with `_` is its own
module's business. What crosses modules is public and says so; a file split by concept, not to stay
under the line cap, keeps each concept's privates inside it."""

from __future__ import annotations

import ast

import pytest

from tests.unit.imports import sources

# Underscored names of other libraries that are their public API: namedtuple's methods, argparse's
# subparsers type, os._exit (a child's exit without cleanup), prometheus_client's value holder, which
# has no public reader, and transformers' config field naming the attention implementation a forward
# dispatches to (what its own `set_attn_implementation` writes; models.poolpass swaps it for one pass),
# and torch's registered oneDNN operators for a packed linear layer, which have no public wrapper: the
# ops inductor's generated code calls for CPU linear layers (models.cpukernels; `can_pack` checks they
# run and falls back to weight-major products where they do not), and transformers' tokenizers' `_decode`,
# where `decode` ends and what a tokenizer class overrides to change its text (models.detokenize decodes
# through Rust only where it is transformers' own).
FOREIGN = {
    "_replace",
    "_asdict",
    "_fields",
    "_SubParsersAction",
    "_exit",
    "_value",
    "_attn_implementation",
    "_reorder_linear_weight",
    "_linear_pointwise",
    "_decode",
}


def _own_classes(tree: ast.AST) -> dict[str, set[str]]:
    """The module's classes -> the underscored attributes and methods each defines (assigned on `self`
    or `cls` inside it, or in its body)."""
    classes: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        names = classes.setdefault(node.name, set())
        for inner in ast.walk(node):
            if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and inner is not node:
                names.add(inner.name)
            elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
                names.add(inner.attr)
            elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                names.add(inner.id)
            elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                names.add(inner.target.id)
    return {name: {n for n in names if n.startswith("_")} for name, names in classes.items()}


def _annotated(tree: ast.AST) -> dict[int, dict[str, str]]:
    """For each function (by id of its node): its parameters and local names annotated with a class name."""

    def named(annotation: ast.expr) -> str:
        return annotation.id if isinstance(annotation, ast.Name) else ast.unparse(annotation).strip("'\"")

    found: dict[int, dict[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            names = {a.arg: named(a.annotation) for a in args if a.annotation is not None}
            for inner in ast.walk(node):
                if isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                    names[inner.target.id] = named(inner.annotation)
            found[id(node)] = names
    return found


def private_uses(rel: str, source: str) -> list[str]:
    """Another module's private names that `source` imports or reads: `x._name` is this module's own
    only where x is `self` or `cls`, one of this module's classes, or a parameter annotated with one of
    them that defines `_name`; getattr, setattr and hasattr with an underscored literal count too."""
    tree = ast.parse(source, filename=rel)
    classes = _own_classes(tree)
    found: list[str] = []

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__") and name not in FOREIGN

    def own(value: ast.expr, name: str, params: dict[str, str]) -> bool:
        if not isinstance(value, ast.Name):
            return False
        if value.id in ("self", "cls"):
            return True
        if value.id in classes:  # a class of this module, by name
            return name in classes[value.id]
        owner = params.get(value.id)
        return owner is not None and name in classes.get(owner, set())

    def visit(node: ast.AST, params: dict[str, str]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = {**params, **annotated[id(node)]}
        if isinstance(node, ast.ImportFrom):
            found.extend(
                f"{rel}:{node.lineno} imports {alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            )
        elif isinstance(node, ast.Attribute) and private(node.attr) and not own(node.value, node.attr, params):
            found.append(f"{rel}:{node.lineno} reads {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
            and not own(node.args[0], node.args[1].value, params)
        ):
            found.append(f"{rel}:{node.lineno} reads {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, params)

    annotated = _annotated(tree)
    visit(tree, {})
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
    assert private_uses("engine/loop.py", source)


@pytest.mark.parametrize(
    "source",
    [
        # `self._cache` exists here, yet `other._cache` is another object's (the old check let it pass)
        "class A:\n    def __init__(self):\n        self._cache = {}\n\ndef f(other):\n    return other._cache\n",
        "def f(model):\n    return getattr(model, '_loading', None)\n",
        "def f(model):\n    setattr(model, '_static', None)\n",
    ],
)
def test_the_check_finds_a_private_name_reached_through_another_object_or_getattr(source):
    assert private_uses("models/x.py", source)


def test_a_modules_own_privates_are_its_own():
    own = "class A:\n    def __init__(self):\n        self._n = 0\n\ndef f(a: A):\n    return a._n\n"
    assert private_uses("core/x.py", own) == []
