"""The package's imports as the layering and cycle tests read them: every `import` statement of a file,
relative ones resolved, lazy ones (inside functions) and type-only ones (`if TYPE_CHECKING:`) counted,
since each still ties the importer to what it names."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cascade_service"


def modules(rel: str, source: str) -> set[str]:
    """Absolute names of the modules a file at `rel` (under cascade_service/) imports, relative imports
    resolved: `from ..models import hf` in core/x.py is cascade_service.models (and .models.hf)."""
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


def top_level_imports(path: Path) -> set[str]:
    """Top-level names of what a file imports (relative imports resolve to cascade_service)."""
    rel = path.relative_to(PACKAGE).as_posix()
    return {name.split(".")[0] for name in modules(rel, path.read_text())}


def sources() -> dict[str, str]:
    """{path under cascade_service/: source} of every module but the generated stubs (proto/*/v1)."""
    return {
        path.relative_to(PACKAGE).as_posix(): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
        if "/v1/" not in path.relative_to(PACKAGE).as_posix()
    }


def layer(rel: str) -> str:
    """A file's layer: its subpackage, or a top-level module's own name (`inprocess.py`: engine)."""
    return rel.split("/")[0].removesuffix(".py")


def module_graph(files: dict[str, str] | None = None) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, every kind of import counted."""
    files = sources() if files is None else files
    names = {}
    for rel in files:
        parts = ["cascade_service", *Path(rel).with_suffix("").parts]
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = rel
    graph: dict[str, set[str]] = {}
    for name, rel in names.items():
        targets = set()
        for imported in modules(rel, files[rel]):
            parts = imported.split(".")
            while parts and ".".join(parts) not in names:
                parts.pop()  # `from pkg.mod import name`: the module, not the name
            target = ".".join(parts)
            # A package's own __init__ runs before any of its modules: not an edge to follow.
            if target and target != name and not name.startswith(target + "."):
                targets.add(target)
        graph[name] = targets
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph`, if it has any."""
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
