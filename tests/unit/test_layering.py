"""Pure core, thin edges (STYLE.md habit 1): each heavy dependency is imported only in its layer."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cascade_service"

# module -> the only subpackages/files allowed to import it
ALLOWED = {
    "ray": ("serving/",),
    # bench/idle.py is a hostile client on purpose (calls that send headers and never a body), which the
    # SDK in client/ cannot be asked to make. transport/ serves and calls the tier API.
    "grpc": ("api/", "client/", "bench/idle.py", "transport/client.py", "transport/server.py"),
    "grpc_health": ("api/", "client/", "bench/idle.py", "transport/server.py"),
    "grpc_reflection": ("api/",),
    "redis": ("sessions/redis_store.py",),
    "greenlet": ("serving/bridge.py",),
    "transformers": ("models/", "zoo/"),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_imports_only_stdlib_and_torch():
    import sys

    allowed = set(sys.stdlib_module_names) | {"torch", "cascade_service"}
    for path in (PACKAGE / "core").rglob("*.py"):
        outside = _imports(path) - allowed
        assert not outside, f"{path.relative_to(PACKAGE)} imports {sorted(outside)}: core is stdlib + torch only"


def test_heavy_dependencies_stay_in_their_layer():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        for module in _imports(path) & set(ALLOWED):
            assert rel.startswith(ALLOWED[module]), f"{rel} imports {module}; only {ALLOWED[module]} may"


UNSAFE_MODULES = {"pickle", "marshal", "shelve", "dill", "cloudpickle"}
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}


def test_nothing_unpickles_or_evaluates_data():
    """Issue 6: no pickle or eval of client data anywhere. The package imports no pickling module,
    calls no eval/exec, loads YAML only with safe_load and tensors only from safetensors."""
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("api/v1/"):
            continue  # generated protobuf stubs
        assert not _imports(path) & UNSAFE_MODULES, f"{rel} imports {sorted(_imports(path) & UNSAFE_MODULES)}"
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
