"""The coordinator deployment's calls: draining them on a stop, and ending a failed stream with its status."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

from ..api.backend import Reply
from ..api.servicer import Unavailable, failure, status_for
from ..api.status import STOPPING

# How long a drain waits for cancelled streams to hand their status to Serve (bounded: a stream whose
# consumer is gone never ends).
STREAM_FLUSH_S = 5.0

T = TypeVar("T")


class Stopped(Unavailable):
    """A call refused or cancelled because the coordinator is draining (CoordinatorDeployment.drain)."""

    def __init__(self) -> None:
        super().__init__(STOPPING)


class Calls:
    """The coordinator's calls in flight, so a stop can drain them: wait, then end what is left.

    A call's work runs in tasks of its own (`run`, `iterate`), which a drain cancels: the call then
    ends with UNAVAILABLE and says why. The task Serve runs a call in is Ray's actor task, which also
    sends each streamed message to the proxy; cancelled while it was sending one (not waiting on our
    work), it ended the call as cancelled, which Ray's proxy reports as CANCELLED "client
    disconnected" (issue 48: 3 of 6 streams in one stop). Without a drain, Serve would end the calls
    by killing the replica once graceful_shutdown_timeout_s passed, and Ray's proxy would report that
    as INTERNAL.
    """

    def __init__(self) -> None:
        self.stopping = False
        self.tasks: set[asyncio.Task] = set()  # the calls' own tasks, running now
        self.ended: set[asyncio.Task] = set()  # those the drain cancelled
        self.streams = 0  # streaming calls whose generator has not ended yet

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Around a whole streaming call, its last message or status included: a drain waits for these
        to end, so Serve is not stopped while a status is still on its way to the proxy."""
        self.streams += 1
        try:
            yield
        finally:
            self.streams -= 1

    async def run(self, work: Awaitable[T]) -> T:
        """`work`'s result, awaited in a task of its own; Stopped when draining (before it starts, or
        once the drain cancels it). A cancel of the caller (Serve's, when the client hangs up or runs
        out of time) reaches the work too, and goes on once the work's finally blocks have run."""
        if self.stopping:
            raise Stopped()
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if task not in self.ended:
                raise
            raise Stopped() from None
        finally:
            self.tasks.discard(task)
            self.ended.discard(task)

    async def iterate(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """`items`, each awaited as `run` awaits its work; closed when the caller leaves early."""
        try:
            while True:
                try:
                    item = await self.run(anext(items))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            await items.aclose()  # type: ignore[attr-defined]  # an async generator's

    async def drain(self, grace_s: float) -> int:
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.tasks and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.tasks)
        for task in left:
            self.ended.add(task)
            task.cancel()
        while self.tasks:  # each ends with its status before the replica stops
            await asyncio.sleep(0.01)
        flushed = loop.time() + STREAM_FLUSH_S
        while self.streams and loop.time() < flushed:
            await asyncio.sleep(0.01)
        return len(left)


def reply_for(exc: Exception) -> Reply:
    code, details = status_for(exc)
    return code.name, details, b""


class StreamFailed(Exception):
    """Ends a server-streaming call whose status the servicer set on the context.

    Ray Serve's gRPC proxy takes a stream's status from each message it forwards, so a stream that
    fails before its first message (or after its last) would end OK and empty; raised with the code
    set on the context, the error reaches the client with that code and the servicer's message.
    """


def raise_if_failed(grpc_context: Any) -> None:
    message = failure(grpc_context) if grpc_context is not None else None
    if message is not None:
        raise StreamFailed(message)
