"""One engine loop per process that holds models (issue 39): every request's work and every model's
forward passes, in one thread.

A task (a request's decode, a tier server's call, a benchmark's generation) runs in a greenlet of its
own on the loop's thread, and the cascade in it stays the plain synchronous recursion of core/: where
a model tier needs a forward pass (`HFModel.forward`), the task parks on that model's queue and the
loop goes on with the others. Once every runnable task has parked, the loop runs each model's waiting
passes as batched passes (grouped by `engine.scheduler.take_batch`, the request with the least model
time first), hands each task its rows and resumes it: `TaskLoop.step`, update -> schedule -> execute.
So there is no thread or event-loop hand-off per forward pass, a request joins or leaves between
passes, and the batch is exactly the requests that were ready: nothing waits on a timer to gather them.

A task that must wait for something slow outside the loop (a remote tier's reply, Redis) parks on a
future run by the loop's executor (`run_blocking`), so the loop's other tasks go on. Front ends
(gRPC, HTTP, Ray replica methods) only submit tasks and take their results or streamed items
(`submit`, `run`, `iterate`, `aiterate`): one hand-off per call or per streamed chunk (an asyncio front
end's chunks: one wake-up of its event loop for all that one step hands over, engine.handoff).

Each task keeps a clock (`TaskClock`): the seconds it ran on the loop outside passes (the cascade's
bookkeeping), its share of each model's passes, and what is left of its wall time, waiting (for a
turn, a pass, a remote reply): the engine's own accounting of where a request's time went.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import greenlet

from .clock import CURRENT_CLOCK, TaskClock
from .handoff import Mailbox, mailbox
from .scheduler import ModelQueue, Pass, turns

T = TypeVar("T")


class _Task:
    def __init__(self, fn: Callable[..., Any], args: tuple, on_item: Callable[[Any], None] | None):
        self.fn, self.args, self.on_item = fn, args, on_item
        self.future: Future = Future()
        self.cancelled = threading.Event()  # its submitter has gone: the task should stop (task_cancelled)
        self.clock = TaskClock()
        self.greenlet: _TaskGreenlet | None = None

    def body(self) -> Any:
        CURRENT_CLOCK.set(self.clock)
        return self.fn(*self.args)


class _TaskGreenlet(greenlet.greenlet):
    def __init__(self, task: _Task, loop: TaskLoop):
        super().__init__(task.body, loop._main)
        self.task, self.loop = task, loop


class TaskLoop:
    """The loop (see the module's docstring). A process's engine core (engine.core.EngineCore) owns
    one, and every model it serves joins it (`engine.core.join_loop`)."""

    _names = itertools.count()

    def __init__(self, name: str | None = None, io_workers: int = 32):
        self.name = name or f"engine-{next(self._names)}"
        self._cond = threading.Condition()
        self._arrived: deque[tuple[_Task, Any, BaseException | None]] = deque()  # from any thread
        self._ready: deque[tuple[_Task, Any, BaseException | None]] = deque()  # the loop's own
        self._batchers: list[ModelQueue] = []
        self._posted: set[Mailbox] = set()  # mailboxes this step's updates posted to, not yet woken
        self._live = 0  # tasks submitted and not finished
        self._closed = False
        self._main: greenlet.greenlet | None = None
        self.executor = ThreadPoolExecutor(io_workers, thread_name_prefix=f"{self.name}-io")
        self.iterations = 0
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def batcher(
        self, name: str, execute: Callable[[list[Pass]], list[Any]], max_batch: int = 64, prefill_chunk: int = 16
    ) -> ModelQueue:
        """A model's place in this loop: its passes (`execute` runs a batch of them: models.batching)
        batched with concurrent requests' (engine.scheduler)."""
        batcher = ModelQueue(self, name, execute, max_batch, prefill_chunk)
        with self._cond:
            self._batchers.append(batcher)
        return batcher

    # --- any thread ------------------------------------------------------------------------------

    def submit(self, fn: Callable[..., T], *args: Any, on_item: Callable[[Any], None] | None = None) -> Future:
        """Run fn(*args) as a task; its result (or exception) comes in the returned future. `on_item` is
        called on the loop's thread with what the task `emit`s (it must not block)."""
        return self._submit(fn, args, on_item).future

    def _submit(self, fn: Callable[..., Any], args: tuple, on_item: Callable[[Any], None] | None = None) -> _Task:
        task = _Task(fn, args, on_item)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the engine loop {self.name} is closed")
            self._live += 1
            self._arrived.append((task, None, None))
            self._cond.notify()
        return task

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) as a task, waited for; inside a task of this loop, simply called."""
        if self.in_task():
            return fn(*args)
        return self.submit(fn, *args).result()

    def iterate(self, make: Callable[[], Iterator[T]]) -> Generator[T, None, None]:
        """The items of the iterator make() returns, made by a task, handed over as they come. Leaving
        the loop early closes the iterator in its task (a generator's finally blocks run there); inside a
        task of this loop, simply iterated (as `run` calls: a task waiting for another task would wait
        for ever)."""
        if self.in_task():
            yield from make()
            return
        items: queue.SimpleQueue = queue.SimpleQueue()
        task = self._submit(_drain, (make, items.put))
        try:
            while True:
                done, value = _handed(*items.get())
                if done:
                    return
                yield value
        finally:
            task.cancelled.set()  # a consumer that leaves early stops the task at its next item or round
            task.future.result()  # its finally blocks ran: caches freed, sessions left as they were

    async def arun(self, fn: Callable[..., T], *args: Any) -> T:
        """`run` for an asyncio caller. If the caller is cancelled, the task is told (task_cancelled)
        and waited for: its finally blocks run before the cancel goes on."""
        task = self._submit(fn, args)
        try:
            return await asyncio.shield(asyncio.wrap_future(task.future))
        except asyncio.CancelledError:
            task.cancelled.set()
            await asyncio.wait([asyncio.wrap_future(task.future)])
            raise

    async def aiterate(self, make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
        """`iterate` for an asyncio consumer: items arrive on its event loop."""
        box = mailbox(asyncio.get_running_loop())
        items: asyncio.Queue = asyncio.Queue()
        task = self._submit(_drain, (make, lambda item: self._post(box, items.put_nowait, item)))
        try:
            while True:
                done, value = _handed(*await items.get())
                if done:
                    return
                yield value
        finally:
            task.cancelled.set()
            await asyncio.wait([asyncio.wrap_future(task.future)])

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        self.executor.shutdown(wait=False, cancel_futures=True)

    # --- inside a task ---------------------------------------------------------------------------

    def in_task(self) -> bool:
        current = greenlet.getcurrent()
        return isinstance(current, _TaskGreenlet) and current.loop is self

    def wait(self, future: Future) -> Any:
        """`future`'s result (or its exception raised): inside a task of this loop the task parks until
        it is done and the loop goes on; elsewhere the calling thread blocks, as `run` simply calls."""
        if not self.in_task():
            return future.result()
        return self.park(("future", future))

    def leave(self, batcher: ModelQueue) -> None:
        """`batcher`'s model leaves this loop (ModelQueue.close, which calls it as a task, so on the
        loop's thread, where the waiting passes live): its waiting passes fail in their tasks."""
        with self._cond:
            if batcher in self._batchers:
                self._batchers.remove(batcher)
        for item in batcher.pending:
            assert item.task is not None
            gone = RuntimeError(f"the model {batcher.name} left the engine loop {self.name} before its pass ran")
            self._ready.append((item.task, None, gone))
        batcher.pending.clear()

    def park(self, why: tuple) -> Any:
        """Switch from the current task back to the loop, saying why: ("pass", batcher, pass) or
        ("future", future); the value the loop resumes it with is returned."""
        assert self._main is not None and self.in_task(), "only a task of this loop parks"
        return self._main.switch(why)

    # --- the loop's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        self._main = greenlet.getcurrent()
        waiting = False  # a model has passes waiting for their turn
        while True:
            with self._cond:
                while not (self._arrived or self._ready or waiting or self._closed):
                    self._cond.wait()
                if self._closed and self._live == 0 and not self._arrived and not self._ready:
                    return
                # New tasks first: a request that just arrived is among those its first pass is
                # batched with, and a long prompt's chunks are cut small as soon as it is here.
                self._ready.extendleft(reversed(self._arrived))
                self._arrived.clear()
            waiting = self.step()

    def step(self) -> bool:
        """One step of the engine, on the loop's thread: update, schedule, execute.

        update: every ready task runs until it parks (on a pass it wants, or a future) or ends; the tasks
        the last step's passes resumed take their rows here. schedule: each model whose turn it is (`turns`:
        a target lets its drafters go first) takes its next batch (ModelQueue.take: the turn of the
        request with the least model time, and the rows that share its pass). execute: each batch runs
        as one pass of its model (ModelQueue.run, the model's side: models.batching), and its rows go
        back to their tasks, ready for the next step. Whether passes are still waiting."""
        self.iterations += 1
        while self._ready:  # update
            self._resume(*self._ready.popleft())
        while self._posted:  # what the updates streamed goes out while the passes compute (engine.handoff)
            self._posted.pop().wake()
        with self._cond:  # read after the tasks ran: one of them may have loaded a model (its queue)
            models = list(self._batchers)
        chosen = turns(models)
        batches = [(model, model.take()) for model in chosen]  # schedule
        began = time.perf_counter()
        for model, batch in batches:  # execute
            self._execute(model, batch)
        elapsed = time.perf_counter() - began
        for model in models:  # the models that let cheaper ones go first waited this long more (turns)
            if model.pending and model not in chosen:
                model.deferred_s += elapsed
        return any(model.pending for model in models)

    def _post(self, box: Mailbox, deliver: Callable[[Any], None], item: Any) -> None:
        """An item for an asyncio front end (`aiterate`), from its task (`_drain`, so on this loop's thread,
        inside a step's updates): the event loop is woken once they are done, with everything they streamed."""
        box.post(deliver, item, wake=False)
        self._posted.add(box)

    def _execute(self, model: ModelQueue, batch: list[Pass]) -> None:
        """One batched pass of `model`; each row's result (or error) readied for its task."""
        began = time.perf_counter()
        outcomes = model.run(batch)
        # The queue's own work around the pass (the timer, the metrics) is the rows' too: charged in
        # proportion to their shares, a round of three passes costs its request three times that,
        # which a round's cost must show (engine.policies.floor).
        elapsed, shares = time.perf_counter() - began, sum(share for *_, share in outcomes)
        scale = elapsed / shares if shares > 0 else 0.0
        for item, result, error, share in outcomes:
            task = item.task
            assert task is not None
            task.clock.pass_s[model.name] = task.clock.pass_s.get(model.name, 0.0) + share * scale
            self._ready.append((task, result, error))

    def _resume(self, task: _Task, value: Any, error: BaseException | None) -> None:
        began = task.clock.stepping_since = time.perf_counter()
        try:
            if task.greenlet is None:  # its first step
                task.greenlet = _TaskGreenlet(task, self)
                why = task.greenlet.switch()
            elif error is not None:
                why = task.greenlet.throw(error)
            else:
                why = task.greenlet.switch(value)
        except BaseException as exc:  # the task raised
            task.clock.run_s += time.perf_counter() - began
            task.clock.stepping_since = None
            self._finish(task, None, exc)
            return
        task.clock.run_s += time.perf_counter() - began
        task.clock.stepping_since = None
        if task.greenlet.dead:
            self._finish(task, why, None)
        elif why[0] == "pass":
            batcher, item = why[1], why[2]
            item.task = task
            batcher.pending.append(item)
        else:  # ("future", future): resumed from the thread that completes it
            why[1].add_done_callback(lambda f: self._arrive(task, f))

    def _arrive(self, task: _Task, future: Future) -> None:
        error = future.exception()
        with self._cond:
            self._arrived.append((task, None if error else future.result(), error))
            self._cond.notify()

    def _finish(self, task: _Task, result: Any, error: BaseException | None) -> None:
        with self._cond:
            self._live -= 1
        if error is not None:
            task.future.set_exception(error)
        else:
            task.future.set_result(result)


def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), which blocks (a remote call, a store): inside an engine loop task it runs on the
    loop's executor while the task is parked and the loop goes on; elsewhere it is simply called."""
    current = greenlet.getcurrent()
    if isinstance(current, _TaskGreenlet):
        began = time.perf_counter()
        try:
            return current.loop.wait(current.loop.executor.submit(fn, *args))
        finally:
            current.task.clock.blocked_s += time.perf_counter() - began
    return fn(*args)


def on_loop_thread(loop: TaskLoop, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on the thread of `loop`, waited for.

    Torch's CPU kernels run on an OpenMP team per calling thread. Once a second thread has run a
    parallel op (a lean drafter packing its weights, a step timed), libgomp sees more threads than
    cores and stops spinning between parallel regions: on 2 cores every pass in the loop took twice
    as long (the quality target, 3 tokens: 5.6 ms, 11-13 ms). So serving models compute there."""
    return loop.run(functools.partial(fn, *args, **kwargs))


def current_loop() -> TaskLoop | None:
    """The engine loop whose task is running now, if any."""
    current = greenlet.getcurrent()
    return current.loop if isinstance(current, _TaskGreenlet) else None


def task_cancelled() -> bool:
    """Whether the current engine loop task's submitter has gone (False outside a task)."""
    current = greenlet.getcurrent()
    return isinstance(current, _TaskGreenlet) and current.task.cancelled.is_set()


def _handed(kind: str, value: Any) -> tuple[bool, Any]:
    """What a `_drain` task handed over: (False, item), (True, None) at its end, or its error raised."""
    if kind == "error":
        raise value
    return kind != "item", value


def _drain(make: Callable[[], Iterator[Any]], put: Callable[[tuple], None]) -> None:
    """A task's body for `iterate`: runs the iterator, hands each item over, closes it when the
    consumer stops early."""
    iterator = make()
    try:
        for item in iterator:
            put(("item", item))
            if task_cancelled():
                break
    except BaseException as exc:
        put(("error", exc))
        return
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
    put(("end", None))


class Blocking:
    """An object whose methods block (the session store's Redis or actor calls), used from engine loop
    tasks: each call runs on the loop's executor while the task is parked (`run_blocking`); outside a
    task, directly. Plain attributes pass through."""

    def __init__(self, target: Any):
        object.__setattr__(self, "_target", target)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            return run_blocking(lambda: value(*args, **kwargs))

        return call
