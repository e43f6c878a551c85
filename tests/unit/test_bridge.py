"""serving/bridge.py: synchronous code run on an event loop, one greenlet per call (issue 7)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cascade_service.serving.bridge import Offloaded, await_, in_bridge, iterate_bridged, run_bridged


def _decode(rounds: int, pause_s: float) -> list[int]:
    """Stands in for a decode: synchronous code that waits on I/O once per round."""
    out = []
    for i in range(rounds):
        await_(asyncio.sleep(pause_s))
        out.append(i)
    return out


def test_many_bridged_calls_wait_together_on_one_thread():
    threads_before = threading.active_count()

    async def main():
        start = time.perf_counter()
        results = await asyncio.gather(*(run_bridged(_decode, 5, 0.05) for _ in range(200)))
        return results, time.perf_counter() - start, threading.active_count()

    results, elapsed, threads_during = asyncio.run(main())
    assert results == [[0, 1, 2, 3, 4]] * 200
    # 200 decodes of 5 x 50 ms waits: one after another they would take 50 s; interleaved, ~0.25 s.
    assert elapsed < 5.0
    assert threads_during <= threads_before + 1  # no thread per call


def test_an_exception_in_the_sync_code_reaches_the_awaiting_caller():
    def fails():
        await_(asyncio.sleep(0))
        raise KeyError("tier gone")

    with pytest.raises(KeyError, match="tier gone"):
        asyncio.run(run_bridged(fails))


def test_an_awaited_failure_is_raised_inside_the_sync_code_where_it_can_be_handled():
    async def broken():
        raise ConnectionError("no reply")

    def handles():
        try:
            await_(broken())
        except ConnectionError as exc:
            return f"handled: {exc}"

    assert asyncio.run(run_bridged(handles)) == "handled: no reply"


def test_cancelling_the_caller_stops_the_sync_code_at_its_await_and_runs_its_cleanup():
    events = []

    def decode():
        try:
            for i in range(1000):
                await_(asyncio.sleep(0.01))
                events.append(i)
        finally:
            events.append("released")

    async def main():
        task = asyncio.ensure_future(run_bridged(decode))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert events[-1] == "released" and 0 < len(events) < 100


def test_a_bridged_iterator_yields_items_and_is_closed_when_the_consumer_stops():
    closed = []

    def chunks():
        try:
            for i in range(10):
                await_(asyncio.sleep(0))
                yield i
        finally:
            closed.append(True)

    async def main():
        seen = []
        async for item in iterate_bridged(chunks):
            seen.append(item)
            if item == 2:
                break
        return seen

    async def consume_all():
        return [item async for item in iterate_bridged(chunks)]

    assert asyncio.run(main()) == [0, 1, 2]
    assert asyncio.run(consume_all()) == list(range(10))
    assert closed == [True, True]


def test_offloaded_methods_run_on_the_pool_when_bridged_and_directly_otherwise():
    class Blocking:
        name = "store"

        def __init__(self):
            self.option = False

        def where(self):
            time.sleep(0.01)
            return threading.current_thread().name

    pool = ThreadPoolExecutor(2, thread_name_prefix="io")
    target = Blocking()
    proxy = Offloaded(target, pool)
    assert proxy.name == "store"
    proxy.option = True  # set on the wrapped object (HFScorer.keep_hidden)
    assert target.option is True
    assert proxy.where() == threading.current_thread().name  # not bridged: a direct call

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        tick = asyncio.ensure_future(ticker())
        names = await asyncio.gather(*(run_bridged(proxy.where) for _ in range(4)))
        tick.cancel()
        return names, ticks

    names, ticks = asyncio.run(main())
    assert all(n.startswith("io") for n in names)
    assert ticks > 0  # the loop kept running while the calls blocked their pool threads
    pool.shutdown()


def test_await_outside_a_bridge_is_an_error():
    assert not in_bridge()
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="outside run_bridged"):
        await_(coro)
    coro.close()
