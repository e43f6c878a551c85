"""The coordinator deployment's calls: draining them on a stop, and ending a failed stream with its status."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from ..api.backend import Reply
from ..api.servicer import Unavailable, failure, status_for
from ..api.status import STOPPING

# How long a drain waits for cancelled streams to hand their status to Serve (bounded: a stream whose
# consumer is gone never ends).
STREAM_FLUSH_S = 5.0


class Stopped(Unavailable):
    """A call refused or cancelled because the coordinator is draining (CoordinatorDeployment.drain)."""

    def __init__(self) -> None:
        super().__init__(STOPPING)


class Calls:
    """The coordinator's calls in flight, so a stop can drain them: wait, then cancel what is left.

    A call cancelled here ends with UNAVAILABLE and says why; without it, Serve would end it by killing
    the replica once graceful_shutdown_timeout_s passed, and Ray's proxy would report that as INTERNAL.
    """

    def __init__(self) -> None:
        self.stopping = False
        self.tasks: set[asyncio.Task] = set()
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

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Run one call; Stopped when draining (before it starts, or once drain cancels it)."""
        if self.stopping:
            raise Stopped()
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if not self.stopping:
                raise  # the caller hung up or ran out of time: Serve's own cancel
            raise Stopped() from None
        finally:
            self.tasks.discard(task)

    async def drain(self, grace_s: float) -> int:
        self.stopping = True
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.tasks and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.tasks)
        for task in left:
            task.cancel()
        while self.tasks:  # each ends with its status before the replica stops
            await asyncio.sleep(0.01)
        flushed = asyncio.get_running_loop().time() + STREAM_FLUSH_S
        while self.streams and asyncio.get_running_loop().time() < flushed:
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
