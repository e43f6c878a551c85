"""One engine core per process (issue 47): it alone loads models, each once, and every wiring asks it for
them. Counted per wiring by watching the one loader (`HFModel.load`), and read from the source for the
wirings that run in Ray replicas (serving/), which no test here can count in process."""

from __future__ import annotations

import ast
import threading
from collections import Counter
from pathlib import Path

import pytest

from cascade_service.bench.zoo import Zoo
from cascade_service.config import Config, GenerationConfig, load_config
from cascade_service.engine.loop import TaskLoop
from cascade_service.inprocess import InProcess
from cascade_service.models.hf import HFModel
from cascade_service.standalone import start_standalone
from cascade_service.zoo.tiny import random_prompts

from ..helpers.tier_servers import serve_group, tiny_cascade

PACKAGE = Path(__file__).resolve().parents[2] / "cascade_service"
PROMPT = random_prompts(1, 10, seed=47)[0]


@pytest.fixture
def loads(monkeypatch):
    """Every model loaded from disk in this process while the test runs: (its directory, the thread)."""
    seen: list[tuple[str, str]] = []
    real = HFModel.load.__func__  # type: ignore[attr-defined]

    def load(cls, path, *args, **kwargs):
        seen.append((Path(path).name, threading.current_thread().name))
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(HFModel, "load", classmethod(load))
    return seen


def _models(loads: list[tuple[str, str]]) -> Counter:
    return Counter(path for path, _ in loads)


def test_an_engine_and_its_variants_load_each_model_once_on_its_loop(tiny_family, loads):
    engine = InProcess(tiny_cascade(tiny_family))
    try:
        assert _models(loads) == {"target": 1, "close": 1, "mid": 1}
        assert {thread for _, thread in loads} == {engine.loop.name}  # on the loop's thread (OpenMP's team)
        assert engine.core.loads == 3 and all(m.batcher is not None for m in engine.models())
        variant = engine.variant(["mid"])  # another schedule over the same weights
        zoo = Zoo(tiny_cascade(tiny_family), engine.core)  # a benchmark's engines, in the same core
        zoo.engine(tiny_cascade(tiny_family, [[4, 2], [0, 3]], mag=False))
        assert variant.generate(PROMPT, GenerationConfig(max_new_tokens=4)).token_ids
        assert _models(loads) == {"target": 1, "close": 1, "mid": 1} and engine.core.loads == 3
    finally:
        engine.core.close()


def test_two_engine_cores_share_nothing(tiny_family, loads):
    # No process-wide global: a second core (a test's, a benchmark's child) has its own loop and models.
    first, second = InProcess(tiny_cascade(tiny_family, mag=False)), InProcess(tiny_cascade(tiny_family, mag=False))
    try:
        assert first.loop is not second.loop and first.target is not second.target
        assert _models(loads) == {"target": 2, "close": 2, "mid": 2}
    finally:
        first.core.close()
        second.core.close()


def test_the_standalone_server_loads_each_model_once_and_builds_one_coordinator(tiny_family, loads, monkeypatch):
    from cascade_service import inprocess as engine_module

    made = []
    real = engine_module.assemble_coordinator
    monkeypatch.setattr(engine_module, "assemble_coordinator", lambda *a, **k: made.append(1) or real(*a, **k))
    served = start_standalone(Config(tiny_cascade(tiny_family)))
    try:
        assert _models(loads) == {"target": 1, "close": 1, "mid": 1}
        assert len(made) == 1  # the server's coordinator; the engine's own is never asked for
        assert served.coordinator.loop is served.engine.loop
    finally:
        served.stop(0)


@pytest.mark.parametrize(
    ("serving", "expected"),
    [({"torch_threads": 1}, 1), ({"torch_threads": 1, "standalone_torch_threads": 0}, None)],
    ids=["as-torch_threads", "every-core"],
)
def test_the_standalone_servers_passes_run_on_its_own_thread_setting(tiny_family, serving, expected):
    # A Ray replica keeps serving.torch_threads; the standalone server, one process with nothing of Ray
    # beside it, takes standalone_torch_threads where set (0: every core), on its loop's thread.
    import os

    import torch

    from cascade_service.config import ServingConfig

    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    served = start_standalone(Config(tiny_cascade(tiny_family), serving=ServingConfig(**serving)))
    try:
        assert served.engine.core.thread_settings().startswith(f"intra-op {expected or cores},")
    finally:
        served.stop(0)
        torch.set_num_threads(before)  # the setting is the process's: the next test starts as it found it


def test_a_tier_server_loads_its_models_once_in_its_own_core(tiny_family, loads):
    server = serve_group(tiny_cascade(tiny_family), ["close", "mid"])
    try:
        assert _models(loads) == {"close": 1, "mid": 1}
        group = server.service.group
        assert group.core.loads == 2 and server.service.engine is group.core.loop
    finally:
        server.stop(0)


def test_the_shipped_demo_config_loads_its_three_models_once(loads):
    # The demo's cascade: large, base and small (MaG is a table), as configs/demo.yaml names them.
    config = load_config(PACKAGE.parent / "configs" / "demo.yaml")
    engine = InProcess(config.cascade)
    try:
        assert sorted(_models(loads).values()) == [1, 1, 1]
    finally:
        engine.core.close()


# --- the wirings in Ray replicas and everything else: read from the source -------------------------------


def _calls(source: str) -> set[str]:
    """What `source` calls or hands on to be called: `Owner.method` for every attribute read off a name
    (`HFModel.load(...)`, `partial(HFModel.load, ...)`, `loader = HFModel.load` all give "HFModel.load"),
    getattr(Owner, "method") the same, and bare names called or passed as an argument."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            owner = node.value.id if isinstance(node.value, ast.Name) else "?"
            found.add(f"{owner}.{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                found.add(func.id)
                args = node.args
                if func.id == "getattr" and len(args) >= 2 and isinstance(args[1], ast.Constant):
                    owner = args[0].id if isinstance(args[0], ast.Name) else "?"
                    found.add(f"{owner}.{args[1].value}")
            found.update(arg.id for arg in node.args if isinstance(arg, ast.Name))
    return found


# Offline tools that train or evaluate models (never serve) load them directly; nothing else may.
OFFLINE = ("zoo/",)
LOADERS = {"HFModel.load", "Seq2SeqModel.load", "kind.load"}


def _violations(rel: str, source: str) -> list[str]:
    calls = _calls(source)
    found = []
    if rel != "engine/core.py" and not rel.startswith(OFFLINE) and calls & LOADERS:
        found.append(f"{rel} loads a model ({sorted(calls & LOADERS)}); ask the engine core")
    if rel != "engine/core.py" and any(c == "join_loop" or c.endswith(".join_loop") for c in calls):
        found.append(f"{rel} joins a model to a loop; the engine core does when it loads a model")
    if rel != "engine/core.py" and "TaskLoop" in calls:
        found.append(f"{rel} makes an engine loop; a process's engine core owns its one")
    return found


def test_only_the_engine_core_loads_models_batches_them_and_makes_a_loop():
    found = [
        v
        for path in sorted(PACKAGE.rglob("*.py"))
        for v in _violations(path.relative_to(PACKAGE).as_posix(), path.read_text())
    ]
    assert not found, found
    assert not hasattr(TaskLoop, "shared")  # no process-wide loop to reach for


@pytest.mark.parametrize(
    "source",
    [
        "model = HFModel.load(path)\n",
        "def build(tier):\n    return Seq2SeqModel.load(tier.path)\n",
        "join_loop(model, loop)\n",
        "loop = TaskLoop('mine')\n",
        # not called where it is named: handed on, or reached by name
        "import functools\nload = functools.partial(HFModel.load, path)\n",
        "def build(tier):\n    return getattr(HFModel, 'load')(tier.path)\n",
        "from cascade_service.engine import core\nenable = core.join_loop\nenable(model, loop)\n",
        "import functools\nmake = functools.partial(TaskLoop, 'mine')\n",
    ],
)
def test_the_source_check_finds_a_second_loader(source):
    # The negative control: a serving replica that loaded, batched or looped on its own is caught.
    assert _violations("serving/app.py", source)
    assert not _violations("engine/core.py", source)


def test_a_loop_task_asking_the_core_for_heads_while_a_model_loads_does_not_deadlock(tiny_family, monkeypatch):
    # The load waits for the loop; a loop task that takes the core's lock meanwhile (here: the load
    # itself asks for the acceptance heads) used to wait for a lock held across the load, for ever.
    from cascade_service.config import ModelTierConfig
    from cascade_service.engine.core import EngineCore

    core = EngineCore()
    real_load = HFModel.load

    def load(*args, **kwargs):
        core.heads()  # on the loop's thread, while the caller waits for this load
        return real_load(*args, **kwargs)

    monkeypatch.setattr(HFModel, "load", load)
    got: list[HFModel] = []
    caller = threading.Thread(target=lambda: got.append(core.model(ModelTierConfig("t", str(tiny_family["mid"])))))
    caller.daemon = True  # a deadlock must fail the test, not hang the suite
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive() and len(got) == 1
    assert core.model(ModelTierConfig("t", str(tiny_family["mid"]))) is got[0] and core.loads == 1
    core.close()


def test_a_models_first_fixed_shape_passes_are_made_on_the_loops_thread(tiny_family, monkeypatch):
    # The warm capture (CUDA graphs on cuda; the same fixed-shape passes uncaptured with graphs
    # "eager", which a CPU runs) runs where the model's passes replay: the loop's thread, not the
    # thread that asked for the model.
    from cascade_service.config import ModelTierConfig
    from cascade_service.engine.core import EngineCore
    from cascade_service.models.staticpass import EagerPasses

    threads: list[str] = []
    real_warm = EagerPasses.warm

    def warm(self, max_rows):
        threads.append(threading.current_thread().name)
        return real_warm(self, max_rows)

    monkeypatch.setattr(EagerPasses, "warm", warm)
    core = EngineCore(name="warm-check")
    try:
        model = core.model(ModelTierConfig("t", str(tiny_family["mid"]), graphs="eager"))
        assert isinstance(model.static, EagerPasses)
        assert threads == [core.loop.name]
    finally:
        core.close()
