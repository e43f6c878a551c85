"""The coordinator's drain (serving.calls.Calls) ends a call UNAVAILABLE whatever its caller is doing.

The caller here stands for Ray's actor task: between two of the call's messages it is busy elsewhere
(sending the last one to the proxy). Cancelling that task, as the drain did before issue 48, ended
the call as cancelled (CANCELLED at the client); the drain cancels only the call's own tasks.
"""

from __future__ import annotations

import asyncio

import pytest

from cascade_service.serving.calls import Calls, Stopped

SENDING_S = 0.2  # the caller's time between two messages, away from the call's work


async def tokens(closed: list[bool]):
    try:
        while True:
            await asyncio.sleep(0.01)  # a decode round
            yield 1
    finally:
        closed.append(True)


async def caller(calls: Calls, closed: list[bool], sent: asyncio.Event) -> str:
    """Ray's task: runs the call's stream and sends each message (a sleep, outside the call's work)."""
    try:
        async for _ in calls.iterate(tokens(closed)):
            sent.set()
            await asyncio.sleep(SENDING_S)
    except Stopped:
        return "stopped"
    return "ended"


def test_a_drain_while_the_caller_sends_a_message_ends_the_stream_stopped_not_cancelled():
    async def run() -> tuple[str, int, list[bool]]:
        calls, closed, sent = Calls(), [], asyncio.Event()
        task = asyncio.ensure_future(caller(calls, closed, sent))
        await sent.wait()  # the caller is now sending, not waiting on the call's work
        ended = await calls.drain(0.0)
        return await task, ended, closed

    outcome, ended, closed = asyncio.run(run())
    assert outcome == "stopped"  # the caller's task was not cancelled: the stream gets its status
    assert ended == 0  # nothing of the call's own was running: the next message is refused
    assert closed == [True]  # the decode's generator was closed


def test_a_drain_while_the_call_works_cancels_its_own_task_and_the_call_ends_stopped():
    async def run() -> tuple[str, int, list[bool]]:
        calls, closed = Calls(), []

        async def slow() -> str:
            try:
                await asyncio.sleep(60)
            finally:
                closed.append(True)
            return "done"

        async def unary() -> str:
            try:
                return await calls.run(slow())
            except Stopped:
                return "stopped"

        task = asyncio.ensure_future(unary())
        await asyncio.sleep(0.05)
        ended = await calls.drain(0.0)
        return await task, ended, closed

    assert asyncio.run(run()) == ("stopped", 1, [True])


def test_the_callers_own_cancel_still_cancels_and_closes_the_work():
    # Serve cancels its task when the client hangs up: that is not a drain, and stays a cancel.
    async def run() -> list[bool]:
        calls, closed, sent = Calls(), [], asyncio.Event()

        async def reader() -> None:
            async for _ in calls.iterate(tokens(closed)):
                sent.set()

        task = asyncio.ensure_future(reader())
        await sent.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return closed

    assert asyncio.run(run()) == [True]
