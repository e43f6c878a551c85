"""Run the synchronous cascade on an asyncio event loop, one greenlet per request (issue 7).

The cascade core (core/cascade.py) is a recursive, synchronous algorithm, and it is the same code
in-process, behind the standalone server and here. On the coordinator replica a request's decode runs
in a greenlet on the event loop's own thread. Wherever it would wait (a remote tier's reply, a
colocated model's forward pass on a worker thread, the session store), it hands the awaitable to the
loop with `await_` and its greenlet is suspended until the result is there; other requests' decodes
and the replica's RPCs run meanwhile. So the coordinator is asyncio end to end: no thread per
request, no cap on decodes in flight but Serve's own `max_ongoing_requests`, and a cancelled call
stops at the await it was in (the CancelledError is raised inside the decode), not at the end of the
round. SQLAlchemy's asyncio layer runs its synchronous core the same way.

What runs on the loop between awaits is the cascade's bookkeeping (MaG lookups, reviews of a block's
rows): a fraction of a millisecond per round. Anything longer must go through `await_` (see
`Offloaded`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Executor
from typing import Any, TypeVar

import greenlet

T = TypeVar("T")


class _Bridged(greenlet.greenlet):
    """A greenlet that runs synchronous code for `run_bridged`; `driver` is the coroutine's greenlet."""

    def __init__(self, fn: Callable[..., Any], driver: greenlet.greenlet):
        super().__init__(fn, driver)
        self.driver = driver


def in_bridge() -> bool:
    """True inside a function that `run_bridged` runs: blocking calls must then go through `await_`."""
    return isinstance(greenlet.getcurrent(), _Bridged)


def await_(awaitable: Awaitable[T]) -> T:
    """Wait for `awaitable` on the event loop from synchronous code that `run_bridged` runs.

    The calling greenlet is suspended, the loop goes on with other work, and the result (or the
    exception, CancelledError included) comes back here.
    """
    current = greenlet.getcurrent()
    if not isinstance(current, _Bridged):
        raise RuntimeError("await_ outside run_bridged: this code must run in a bridged decode")
    return current.driver.switch(awaitable)


async def run_bridged(fn: Callable[..., T], *args: Any) -> T:
    """Run fn(*args) in a greenlet of its own, awaiting for it whatever it passes to `await_`."""
    child = _Bridged(fn, greenlet.getcurrent())
    pending = child.switch(*args)
    while not child.dead:
        try:
            value = await pending
        except BaseException:
            pending = child.throw(*sys.exc_info())
        else:
            pending = child.switch(value)
    return pending


async def iterate_bridged(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Iterate the synchronous iterator make() returns, each step bridged; closed when the consumer stops."""
    iterator = await run_bridged(make)
    done = object()
    try:
        while (item := await run_bridged(next, iterator, done)) is not done:
            yield item
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:  # a generator's finally blocks (releasing tier caches) may await too
            await run_bridged(close)


class Offloaded:
    """A blocking object's methods, run on `executor` and awaited through `await_` when bridged.

    Wraps what a bridged decode calls that blocks the calling thread: a colocated model's scorer
    (its forward passes) and the session store (Redis, or a Ray actor). Outside a bridge (tests,
    worker threads) a method runs directly. Plain attributes pass through.
    """

    def __init__(self, target: Any, executor: Executor):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_executor", executor)

    def __setattr__(self, name: str, value: Any) -> None:  # options the core sets (HFScorer.keep_hidden)
        setattr(self._target, name, value)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            if not in_bridge():
                return value(*args, **kwargs)
            loop = asyncio.get_running_loop()
            return await_(loop.run_in_executor(self._executor, lambda: value(*args, **kwargs)))

        return call
