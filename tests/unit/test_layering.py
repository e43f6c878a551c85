"""Pure core, thin edges (STYLE.md habit 1): each heavy dependency is imported only in its layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
    "greenlet": ("models/loop.py",),
    "transformers": ("models/", "zoo/"),
}


# layer (a subpackage, or a top-level module) -> the other layers of the package it may import:
# dependencies point downwards (docs/architecture.md). Layers not listed are not constrained here.
LAYERS = {
    "core": set(),
    "scheduling": {"core"},
    "sessions": {"core"},
    "metrics": {"core"},
    "models": {"core", "metrics", "scheduling"},
    "zoo": {"core", "models", "prompts", "paths"},
    "config": {"core", "paths", "scheduling"},
    "client": {"api"},
    "coordinator": {"config", "core", "metrics", "scheduling", "sessions", "textstream"},
}


def _modules(rel: str, source: str) -> set[str]:
    """Absolute names of the modules a file at `rel` (under cascade_service/) imports, relative
    imports resolved: `from ..models import hf` in core/x.py is cascade_service.models."""
    package = ["cascade_service", *Path(rel).parent.parts]  # a module's package, or an __init__'s own
    names = set()
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = [*base, node.module] if node.module else base
                names.add(".".join(module))
                # `from . import x`, `from .pkg import x`: x may be a module of that package
                names.update(".".join([*module, alias.name]) for alias in node.names)
            elif node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _imports(path: Path) -> set[str]:
    """Top-level names of what a file imports (relative imports resolve to cascade_service)."""
    rel = path.relative_to(PACKAGE).as_posix()
    return {name.split(".")[0] for name in _modules(rel, path.read_text())}


def _layer(rel: str) -> str:
    return rel.split("/")[0].removesuffix(".py")


def layer_violations(rel: str, source: str) -> list[str]:
    """What a file at `rel` imports from layers above its own (LAYERS), relative imports included."""
    layer = _layer(rel)
    if layer not in LAYERS:
        return []
    allowed = LAYERS[layer] | {layer}
    found = []
    for name in _modules(rel, source):
        parts = name.split(".")
        if parts[0] == "cascade_service" and len(parts) > 1 and parts[1] not in allowed:
            found.append(f"{rel} imports {name} ({layer} may import only {sorted(allowed)})")
    return found


def test_each_layer_imports_only_the_layers_below_it():
    found = [
        v
        for path in PACKAGE.rglob("*.py")
        for v in layer_violations(path.relative_to(PACKAGE).as_posix(), path.read_text())
    ]
    assert not found, found


@pytest.mark.parametrize(
    "rel, source",
    [
        ("core/cascade.py", "from ..models.hf import HFModel\n"),  # relative, two levels up
        ("core/cascade.py", "from .. import engine\n"),
        ("scheduling/load.py", "from ..config import Config\n"),
        ("core/cascade.py", "import cascade_service.serving.app\n"),  # absolute
        ("coordinator.py", "from .runtime.leaves import Leaves\n"),  # a top-level module
    ],
)
def test_the_layering_rule_fails_on_a_forbidden_import(rel, source):
    # The negative control: each of these would break the rule, and the check says so.
    assert layer_violations(rel, source)


def test_relative_imports_within_a_layer_are_allowed():
    assert layer_violations("core/cascade.py", "from .schedule import Schedule\nfrom . import stats\n") == []
    assert "cascade_service.core.tier" in _modules("core/cascade.py", "from ..core.tier import Tier\n")


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


def _runtime_imports(rel: str, source: str) -> set[str]:
    """The package's modules a file imports when it runs (lazy imports inside functions included;
    `if TYPE_CHECKING:` blocks, which never run, left out)."""
    tree = ast.parse(source, filename=rel)
    typing_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for child in ast.walk(stmt)
    }
    kept = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in typing_only]
    return _modules(rel, "\n".join(ast.unparse(n) for n in kept))


def _module_graph() -> dict[str, set[str]]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        parts = ["cascade_service", *Path(rel).with_suffix("").parts]
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        targets = set()
        for imported in _runtime_imports(path.relative_to(PACKAGE).as_posix(), path.read_text()):
            parts = imported.split(".")
            while parts and ".".join(parts) not in names:
                parts.pop()  # `from pkg.mod import name`: the module, not the name
            target = ".".join(parts)
            # A package's own __init__ runs before any of its modules: not an edge to follow.
            if target and target != name and not name.startswith(target + "."):
                targets.add(target)
        graph[name] = targets
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, if it has any."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return None


def test_no_module_of_the_package_imports_itself_back():
    # Issue 39: core.request -> verify -> review / sampling -> request, models.hf <-> models.seq2seq,
    # api <-> transport were such circles; lazy imports count (they still run), type-only ones do not.
    assert _cycle(_module_graph()) is None, " -> ".join(_cycle(_module_graph()) or [])


def test_the_cycle_check_finds_a_lazy_circle():
    # The negative control: a function-level import back makes a cycle.
    graph = _module_graph()
    graph["cascade_service.core.sampling"] = graph["cascade_service.core.sampling"] | {"cascade_service.core.request"}
    graph["cascade_service.core.request"] = graph["cascade_service.core.request"] | {"cascade_service.core.verify"}
    assert _cycle(graph) is not None
    lazy = "def f():\n    from ..core import request\n"
    assert "cascade_service.core.request" in _runtime_imports("core/sampling.py", lazy)
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import verify\n"
    assert "cascade_service.core.verify" not in _runtime_imports("core/request.py", typed)
