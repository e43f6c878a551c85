"""Issue 6: nothing in the package unpickles or evaluates data."""

from __future__ import annotations

import ast

from tests.unit.imports import PACKAGE, top_level_imports

UNSAFE_MODULES = {"pickle", "marshal", "shelve", "dill", "cloudpickle"}
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}


def test_nothing_unpickles_or_evaluates_data():
    """Issue 6: no pickle or eval of client data anywhere. The package imports no pickling module,
    calls no eval/exec, loads YAML only with safe_load and tensors only from safetensors."""
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("proto/"):
            continue  # generated protobuf stubs
        assert not top_level_imports(path) & UNSAFE_MODULES, (
            f"{rel} imports {sorted(top_level_imports(path) & UNSAFE_MODULES)}"
        )
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
                bare = isinstance(func, ast.Name) or owner == "builtins"  # `module.eval()` is torch's eval mode
                assert not (bare and name in UNSAFE_CALLS), f"{rel}:{node.lineno} calls {name}"
                assert not (owner == "torch" and name == "load"), f"{rel}:{node.lineno} calls torch.load (pickle)"
                assert not (owner == "yaml" and name in ("load", "unsafe_load", "full_load")), (
                    f"{rel}:{node.lineno} calls yaml.{name}; use yaml.safe_load"
                )
