"""Layers as a picture (docs/architecture.md): every package and top-level module of cascade_service has
a place, names the layers it may import, and imports nothing else of the package, nor any heavy
dependency outside the layers that own it. Relative, lazy and type-only imports all count."""

from __future__ import annotations

import pytest

from tests.unit.imports import PACKAGE, cycle, layer, modules, sources

# Bottom to top. Each layer -> the other layers it may import: dependencies point downwards.
LAYERS: dict[str, set[str]] = {
    # Leaves: the wire's types, the cascade's pure algorithm, small helpers. They import nothing here.
    "__init__": set(),
    "proto": set(),
    "core": set(),
    "paths": set(),
    "prompts": set(),
    "extras": set(),
    "procfs": set(),
    "quiet": {"paths"},
    "output": {"core"},
    "sessions": {"core"},
    "metrics": {"core"},
    "config": {"core", "paths"},
    # The model runner: weights, KV pools, forward passes of a batch it is handed. Nothing of the engine.
    "models": {"core", "metrics"},
    # The engine: the loop and its step (schedule -> execute -> update), the scheduler, clocks, the
    # speculation policies, the core that loads each model once and joins it to the loop.
    "engine": {"config", "core", "metrics", "models"},
    "startup": {"config", "models"},
    # One request, built once from any front end and validated once.
    "intake": {"config", "core"},
    # Wire helpers both ends share, the SDK, the tier wire and the coordinator's view of a remote tier.
    "rpc": {"core", "proto"},  # core.limits: the checks every edge shares (stdlib only)
    "client": {"proto"},
    "transport": {"config", "core", "engine", "proto", "rpc"},
    "coordinator": {"config", "core", "engine", "intake", "metrics", "output", "sessions"},
    # The client edge: gRPC and HTTP front ends over a coordinator.
    "api": {"coordinator", "core", "engine", "intake", "metrics", "output", "proto", "rpc", "sessions"},
    # The composition root: a coordinator assembled over an engine's tiers.
    "runtime": {"config", "coordinator", "core", "engine", "extras", "metrics", "models", "sessions", "startup"},
    # What a tier server process runs.
    "tierhost": {"__init__", "config", "core", "engine", "models", "proto", "rpc", "runtime", "startup"}
    | {"transport"},
    # Wirings: in process, one process serving gRPC/HTTP, the Ray Serve app.
    "inprocess": {"config", "coordinator", "core", "engine", "models", "runtime", "sessions", "startup"}
    | {"tierhost", "transport"},
    "standalone": {"api", "config", "coordinator", "engine", "inprocess", "rpc", "runtime", "sessions"},
    "serving": {
        "api",
        "client",
        "config",
        "coordinator",
        "core",
        "engine",
        "intake",
        "metrics",
        "models",
        "procfs",
        "proto",
        "rpc",
    }
    | {"runtime", "sessions", "startup", "tierhost", "transport"},
    # Offline tools and commands on top.
    "zoo": {"core", "models", "paths", "prompts"},
    "tune": {"config", "core", "inprocess", "prompts"},
    "bench": {"api", "client", "config", "core", "engine", "extras", "inprocess", "models", "paths", "procfs"}
    | {"prompts", "proto", "runtime", "serving", "sessions", "standalone", "tierhost", "transport", "zoo"},
    "demo": {"bench", "client", "config", "core", "models", "paths", "prompts", "quiet", "serving", "zoo"},
    "cli": {"api", "bench", "client", "config", "core", "demo", "engine", "extras", "inprocess", "intake", "models"}
    | {"paths", "rpc", "runtime", "serving", "standalone", "tierhost", "tune", "zoo"},
}

# A heavy or process-wide dependency -> the only places that import it.
THIRD_PARTY = {
    "ray": ("serving/",),
    # bench/idle.py is a hostile client on purpose (calls that send headers and never a body), which the
    # SDK in client/ cannot be asked to make. tierhost/ serves the tier API, transport/ calls it.
    # serving/proxy.py: Ray Serve's gRPC proxy, given our servicer with its rich error details.
    "grpc": ("api/", "client/", "rpc/", "bench/idle.py", "transport/client.py", "tierhost/server.py", "proto/")
    + ("serving/proxy.py",),
    "grpc_health": ("api/", "client/", "rpc/", "bench/idle.py", "tierhost/server.py"),
    "grpc_reflection": ("rpc/", "api/"),
    "redis": ("sessions/redis_store.py",),
    "greenlet": ("engine/loop.py",),
    # bench/grammar_engines.py times transformers' own tokenizer-driven baselines beside ours.
    "transformers": ("models/", "zoo/", "bench/grammar_engines.py"),
}


def layer_violations(rel: str, source: str) -> list[str]:
    """What a file at `rel` imports from layers its own may not import (LAYERS)."""
    own = layer(rel)
    allowed = LAYERS[own] | {own}
    found = []
    for name in modules(rel, source):
        parts = name.split(".")
        if parts[0] == "cascade_service" and len(parts) > 1 and layer(parts[1]) not in allowed | {"__version__"}:
            found.append(f"{rel} imports {name} ({own} may import only {sorted(allowed)})")
    return found


def third_party_violations(rel: str, source: str) -> list[str]:
    tops = {name.split(".")[0] for name in modules(rel, source)}
    return [
        f"{rel} imports {module} (only {', '.join(owners)} may)"
        for module, owners in THIRD_PARTY.items()
        if module in tops and not rel.startswith(owners)
    ]


def test_every_package_and_module_has_its_layer():
    on_disk = {layer(rel) for rel in sources()}
    assert on_disk - set(LAYERS) == set(), "a package without a place in LAYERS"
    assert set(LAYERS) - on_disk == set(), "LAYERS names a package that is gone"


def test_the_layers_form_a_picture_without_circles():
    # A layer's allowed imports are all below it: the declared graph itself has no cycle, and each
    # allowed layer comes earlier in LAYERS (bottom to top, as docs/architecture.md draws them).
    assert cycle({name: set(deps) for name, deps in LAYERS.items()}) is None
    order = list(LAYERS)
    for name, deps in LAYERS.items():
        above = [d for d in deps if order.index(d) > order.index(name)]
        assert not above, f"{name} may import {above}, listed above it"


def test_each_layer_imports_only_the_layers_below_it():
    found = [v for rel, source in sources().items() for v in layer_violations(rel, source)]
    assert not found, found


def test_each_heavy_dependency_stays_in_its_layer():
    found = [v for rel, source in sources().items() for v in third_party_violations(rel, source)]
    assert not found, found


def _forbidden(name: str) -> str:
    """A layer `name` may not import: the lowest one above it, or one it skips."""
    order = list(LAYERS)
    return next(other for other in order if other != name and other not in LAYERS[name] and other != "__init__")


def _file_of(name: str) -> str:
    return f"{name}/x.py" if (PACKAGE / name).is_dir() else f"{name}.py"


@pytest.mark.parametrize("name", sorted(LAYERS.keys() - {"__init__"}))
@pytest.mark.parametrize("how", ["absolute", "relative", "lazy", "type-only"])
def test_each_layer_rule_fails_on_a_forbidden_import(name, how):
    # The negative control, one per rule and kind of import: each of these breaks `name`'s rule.
    rel, other = _file_of(name), _forbidden(name)
    dots = ".." if "/" in rel else "."
    source = {
        "absolute": f"import cascade_service.{other}\n",
        "relative": f"from {dots}{other} import thing\n",
        "lazy": f"def f():\n    from {dots} import {other}\n",
        "type-only": f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {dots}{other} import T\n",
    }[how]
    assert layer_violations(rel, source)


@pytest.mark.parametrize("module", sorted(THIRD_PARTY))
def test_each_dependency_rule_fails_outside_its_owners(module):
    assert third_party_violations("core/x.py", f"def f():\n    import {module}.sub\n")


def test_imports_within_a_layer_are_allowed():
    assert layer_violations("core/cascade.py", "from .schedule import Schedule\nfrom . import stats\n") == []
    assert "cascade_service.core.tier" in modules("core/cascade.py", "from ..core.tier import Tier\n")


def test_no_module_of_the_package_imports_itself_back():
    # Issue 39: core.request -> verify -> review / sampling -> request, models.hf <-> models.seq2seq,
    # api <-> transport were such circles; issue 47: models.loop <-> models.batching (type-only).
    from tests.unit.imports import module_graph

    graph = module_graph()
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_the_cycle_check_finds_lazy_and_type_only_circles():
    from tests.unit.imports import module_graph

    files = sources()
    lazy = dict(files, **{"core/sampling.py": files["core/sampling.py"] + "\ndef f():\n    from . import decode\n"})
    assert cycle(module_graph(lazy)) is not None  # core.decode imports core.sampling's users
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loop import TaskLoop\n"
    batcher = dict(files, **{"engine/scheduler.py": files["engine/scheduler.py"] + typed})
    assert cycle(module_graph(batcher)) is not None  # engine.loop imports the batcher


# What a request runs with (its generator, its grammar state, its tiers): built by intake.py per request.
RUNTIME_STATE = {"torch", "RequestState", "GrammarMask", "StatisticalTier", "PredictionProposer"}


def runtime_state_in(rel: str, source: str) -> set[str]:
    """The runtime types (or torch) a config module imports."""
    return {name.split(".")[-1] for name in modules(rel, source)} & RUNTIME_STATE | (
        {"torch"} & {name.split(".")[0] for name in modules(rel, source)}
    )


def test_the_config_builds_no_runtime_state():
    found = {rel: runtime_state_in(rel, src) for rel, src in sources().items() if rel.startswith("config/")}
    assert not any(found.values()), found
    # The negative control: what config/__init__.py built before issue 47.
    assert runtime_state_in("config/__init__.py", "import torch\nfrom ..core.cascade import RequestState\n")


# Imported by every front end (the edge, Ray's proxy, a tier server's gRPC side): none may load torch or
# transformers for it. The loop once reached the `models` package (which imports transformers on import)
# for a dataclass, and a stop behind Ray's proxy took 8-9 s instead of 4 (test_stop's bound is 7).
LIGHT = ("cascade_service.engine.loop", "cascade_service.engine.scheduler", "cascade_service.engine.clock")


def _heavy_after_import(*modules: str) -> list[str]:
    import subprocess
    import sys

    code = f"import sys\nimport {', '.join(modules)}\nprint(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    return eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_the_engine_loop_imports_without_torch_or_transformers():
    assert _heavy_after_import(*LIGHT) == []
    assert _heavy_after_import("cascade_service.models.batching") == ["torch", "transformers"]  # the check sees them
