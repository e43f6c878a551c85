"""The engine loop (engine/loop.py) on fake models: tasks interleave at their passes, a blocking call
parks only its own task, errors and cancellation reach the right task, a consumer that leaves early
closes its task's generator, and each task's clock says where its time went."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest
from transformers import DynamicCache

from cascade_service.engine.clock import CURRENT_CLOCK, charged
from cascade_service.engine.loop import TaskLoop, run_blocking, task_cancelled
from cascade_service.models import batching

from ..helpers.counting_loop import CountingLoop


@pytest.fixture
def loop(monkeypatch):
    passes: list[list[int]] = []

    def fake(model, batch):  # a pass: 5 ms, each row's result is its fed token + 100
        passes.append([p.fed[0] for p in batch])
        time.sleep(0.005)
        return [p.fed[0] + 100 for p in batch]

    monkeypatch.setattr(batching, "forward_batch", fake)
    engine = TaskLoop("test-loop")
    engine.passes = passes  # type: ignore[attr-defined]
    yield engine
    engine.close()


def _together(loop: TaskLoop, calls: list[tuple]) -> list:
    """Submit the calls from one task, so the loop takes them in its next iteration, all at once."""
    return loop.run(lambda: [loop.submit(*call) for call in calls])


def _model(loop: TaskLoop, name: str = "m"):
    return loop.batcher(name, batching.executor(types.SimpleNamespace(name=name, sync=lambda: None)))


def test_tasks_interleave_at_their_passes_and_share_them(loop):
    model = _model(loop)
    order: list[tuple[int, int]] = []

    def request(i: int) -> list[int]:
        cache, out = DynamicCache(), []
        for step in range(3):
            order.append((i, step))
            out.append(model.forward([i], cache, 1))
        return out

    futures = _together(loop, [(request, i) for i in range(4)])
    assert [f.result() for f in futures] == [[100 + i] * 3 for i in range(4)]
    assert model.batch_sizes == {4: 3}  # every pass held all four
    assert order == [(i, s) for s in range(3) for i in range(4)]  # each ran to its pass, then the next


def test_a_blocking_call_parks_only_its_own_task(loop):
    model = _model(loop)
    release = threading.Event()
    done: list[str] = []

    def waits() -> str:
        run_blocking(release.wait, 10)  # on the loop's executor: the loop goes on
        done.append("waiter")
        return "waited"

    def works() -> int:
        cache = DynamicCache()
        for _ in range(5):
            model.forward([1], cache, 1)
        done.append("worker")
        return 5

    waiter, worker = loop.submit(waits), loop.submit(works)
    assert worker.result(timeout=10) == 5 and done == ["worker"]  # it ran while the other waited
    release.set()
    assert waiter.result(timeout=10) == "waited" and done == ["worker", "waiter"]


def test_an_error_reaches_its_task_and_the_loop_goes_on(loop, monkeypatch):
    model = _model(loop)

    def boom(model_, batch):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(batching, "forward_batch", boom)
    with pytest.raises(RuntimeError, match="out of memory"):
        loop.run(model.forward, [1], DynamicCache(), 1)
    with pytest.raises(ValueError, match="bad"):
        loop.run(lambda: (_ for _ in ()).throw(ValueError("bad")))
    assert loop.run(lambda: 41 + 1) == 42


def test_a_consumer_that_leaves_early_closes_the_tasks_generator(loop):
    model = _model(loop)
    closed = threading.Event()

    def decode():
        cache = DynamicCache()
        try:
            for _ in range(1000):
                if task_cancelled():
                    return
                yield model.forward([7], cache, 1)
        finally:
            closed.set()  # a decode's caches are freed here

    items = loop.iterate(decode)
    assert [next(items) for _ in range(3)] == [107, 107, 107]
    items.close()
    assert closed.is_set() and len(loop.passes) < 10


def test_an_asyncio_caller_that_is_cancelled_tells_its_task(loop):
    model = _model(loop)
    rounds: list[int] = []

    def decode() -> str:
        cache = DynamicCache()
        while not task_cancelled():
            model.forward([1], cache, 1)
            rounds.append(1)
        return "stopped"

    async def caller() -> None:
        call = asyncio.ensure_future(loop.arun(decode))
        while len(rounds) < 3:
            await asyncio.sleep(0.005)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(caller())
    stopped_at = len(rounds)
    time.sleep(0.05)
    assert len(rounds) == stopped_at  # nothing ran after the cancel reached it


def test_items_stream_to_an_asyncio_consumer(loop):
    model = _model(loop)

    def decode():
        cache = DynamicCache()
        for i in range(4):
            yield model.forward([i], cache, 1)

    async def consume() -> list[int]:
        return [item async for item in loop.aiterate(decode)]

    assert asyncio.run(consume()) == [100, 101, 102, 103]


def test_each_task_clock_holds_its_passes_and_its_own_time(loop):
    model = _model(loop, "large")

    def request() -> tuple[float, float, float]:
        cache = DynamicCache()
        start = charged()
        for _ in range(4):
            model.forward([1], cache, 1)
        busy = time.perf_counter() + 0.02
        while time.perf_counter() < busy:  # 20 ms of its own work on the loop
            pass
        clock = CURRENT_CLOCK.get()
        assert clock is not None
        return clock.pass_s["large"], clock.ran_s(), charged() - start

    (passes, ran, charged_s), (other, _, _) = (f.result() for f in _together(loop, [(request,), (request,)]))
    assert passes == pytest.approx(4 * 0.0025, rel=0.5)  # half of each shared 5 ms pass
    assert other == pytest.approx(passes, rel=0.5)
    assert ran >= 0.02 and charged_s == pytest.approx(passes + ran, abs=0.005)
    assert CURRENT_CLOCK.get() is None  # the caller's thread has none: each task's is its own


def test_a_model_called_from_another_thread_runs_its_pass_in_the_loop(loop):
    model = _model(loop)
    seen: list[str] = []
    real = batching.forward_batch

    def where(model_, batch):
        seen.append(threading.current_thread().name)
        return real(model_, batch)

    batching.forward_batch = where
    try:
        assert model.forward([3], DynamicCache(), 1) == 103  # not in a task: handed to the loop
    finally:
        batching.forward_batch = real
    assert seen == ["test-loop"]


def test_a_model_loaded_inside_a_task_serves_that_task(loop):
    # bench and the model builders run on the loop's thread (engine.loop.on_loop_thread), so a task can
    # load a model and pass through it at once: its batcher is new to the iteration under way.
    def load_and_decode() -> int:
        model = _model(loop, "loaded-in-a-task")
        return model.forward([7], DynamicCache(), 1)

    assert loop.submit(load_and_decode).result(timeout=10) == 107


def test_work_handed_to_the_loop_thread_runs_there():
    from cascade_service.engine.loop import on_loop_thread

    engine = TaskLoop("thread-check")
    try:
        assert on_loop_thread(engine, lambda: threading.current_thread().name) == "thread-check"
        # and inside one of its tasks it is simply called (no hand-off, no deadlock)
        assert engine.run(lambda: on_loop_thread(engine, threading.current_thread)) is engine._thread
    finally:
        engine.close()


def test_the_floors_clock_counts_the_passes_a_drafting_round_waited_through(loop):
    # A request drafting with a small model takes three of its passes while a plain request's target
    # pass runs in each of those loop iterations: its round waited through all of them. Shares of the
    # passes (charged) see only its own small ones; the floor's clock (waited) sees the wait.
    from cascade_service.engine.clock import waited
    from cascade_service.engine.policies.floor import GoodputFloor

    target, drafter = _model(loop, "target"), _model(loop, "drafter")

    def plain() -> None:
        cache = DynamicCache()
        for _ in range(4):
            target.forward([1], cache, 1)

    def drafting() -> tuple[float, float]:
        cache = DynamicCache()
        began, began_charged = waited(), charged()
        for _ in range(3):
            drafter.forward([2], cache, 1)
        target.forward([3], cache, 1)
        return waited() - began, charged() - began_charged

    futures = _together(loop, [(plain,), (drafting,)])
    wall, shares = futures[1].result()
    assert wall >= 4 * 0.005  # three drafter iterations (each with the plain request's pass) and its own
    assert shares < 0.6 * wall  # what the share clock charged: about half
    assert GoodputFloor.__init__.__defaults__ is not None and waited in GoodputFloor.__init__.__defaults__


def test_a_model_that_leaves_the_loop_fails_its_waiting_pass_and_every_later_one(loop):
    model = _model(loop)

    def request() -> int:
        return model.forward([1], DynamicCache(), 1)

    def closer() -> None:  # runs after `request` parked, before the loop's passes
        model.close()

    waiting, closed = _together(loop, [(request,), (closer,)])
    closed.result()
    with pytest.raises(RuntimeError, match="left the engine loop"):
        waiting.result(timeout=10)
    with pytest.raises(RuntimeError, match="has left the engine loop"):
        loop.run(request)
    assert loop.passes == [] and model not in loop._batchers
    model.close()  # again: nothing more to do


@pytest.fixture
def priced(monkeypatch):
    """A loop whose fake passes cost what their model's name says: "target" 10 ms, "drafter" 1 ms."""
    passes: list[tuple[str, list[int]]] = []
    seconds = {"target": 0.010, "drafter": 0.001}
    took: dict[str, list[float]] = {"target": [], "drafter": []}

    def fake(model, batch):
        passes.append((model.name, [p.fed[0] for p in batch]))
        began = time.perf_counter()
        time.sleep(seconds[model.name])
        took[model.name].append(time.perf_counter() - began)
        return [p.fed[0] + 100 for p in batch]

    monkeypatch.setattr(batching, "forward_batch", fake)
    engine = TaskLoop("priced-loop")
    engine.passes = passes  # type: ignore[attr-defined]
    engine.took = took  # type: ignore[attr-defined]
    target, drafter = _model(engine, "target"), _model(engine, "drafter")
    engine.run(lambda: (target.forward([0], DynamicCache(), 1), drafter.forward([0], DynamicCache(), 1)))
    passes.clear()  # each model's pass time is known from here
    yield engine, target, drafter
    engine.close()


def _request(*steps: tuple) -> None:
    """One request's passes over one cache: (model, token, how many) after another."""
    cache = DynamicCache()
    for model, token, count in steps:
        for _ in range(count):
            model.forward([token], cache, 1)


def test_a_drafting_rounds_steps_run_before_the_targets_next_pass_which_it_then_joins(priced):
    # Stepped together, each of the drafting request's three drafter steps would wait for a target pass
    # of the plain request's, and its verification would join the plain request's fourth pass. Cheaper
    # models first (engine.scheduler.turns), its drafts are ready for the target's first pass.
    loop, target, drafter = priced
    plain, drafting = (_request, (target, 1, 4)), (_request, (drafter, 2, 3), (target, 3, 1))
    for future in _together(loop, [plain, drafting]):
        future.result(timeout=10)
    assert loop.passes[:4] == [("drafter", [2])] * 3 + [("target", [1, 3])]
    assert [name for name, _ in loop.passes].count("target") == 4  # the plain request's four, one shared


def test_a_target_waits_for_its_drafters_at_most_its_own_pass_time(priced):
    # A drafter reading a long context passes after pass; the target lets it go first only for about
    # its own pass's time (DEFER), so the plain request keeps decoding meanwhile.
    from cascade_service.engine.scheduler import DEFER

    loop, target, drafter = priced
    plain, reading = (_request, (target, 1, 3)), (_request, (drafter, 2, 60))
    for future in _together(loop, [plain, reading]):
        future.result(timeout=10)
    names = [name for name, _ in loop.passes]
    targets = [i for i, name in enumerate(names) if name == "target"]
    assert len(targets) == 3
    gaps = [b - a - 1 for a, b in zip([-1] + targets, targets)]  # drafter passes before each target pass
    assert all(gap >= 2 for gap in gaps)  # it let the drafter go first
    # ~10 drafter passes of 1 ms fill one 10 ms target pass (as long as they took on this machine)
    assert max(gaps) <= DEFER * max(loop.took["target"]) / min(loop.took["drafter"]) + 2  # the last one crosses it
    assert targets[-1] < 50  # done decoding well before the drafter's 60 passes are


def test_streams_wake_their_event_loop_once_per_step_not_once_per_chunk(loop):
    # 16 streams, each a task that parks on one model's passes between its chunks, as decoding does:
    # each step's updates stream up to 16 chunks, and the front end's event loop is woken once for them
    # as the step's passes begin (engine.handoff), not once per chunk.
    model = _model(loop)
    aloop = CountingLoop()

    def stream(i: int):
        cache = DynamicCache()
        for step in range(8):
            model.forward([i], cache, 1)
            yield (i, step)

    async def consume(i: int) -> list:
        return [item async for item in loop.aiterate(lambda: stream(i))]

    async def streams() -> list:
        return await asyncio.gather(*(consume(i) for i in range(16)))

    try:
        assert aloop.run_until_complete(streams()) == [[(i, step) for step in range(8)] for i in range(16)]
        chunks = 16 * (8 + 1)  # each stream's items and its end
        assert 0 < aloop.wakeups <= chunks // 4, aloop.wakeups  # 24 here: one a step, and one as each stream ends
    finally:
        aloop.close()
