"""A backend whose calls block (the Ray edge's handle to the coordinator deployment in another process,
a test's fake deployment) behind the asyncio front end: each admitted call on a worker thread.

The coordinator in this process needs none of this (`api.server.LocalBackend` awaits the engine loop
on the front end's event loop); a call that waits on another process holds a thread here while it does,
as the transport's client blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc

from .backend import Call, Reply
from .status import TOO_LARGE

log = logging.getLogger(__name__)


class BlockingBackend(Protocol):
    """What serves a call on a worker thread; both methods may block."""

    def call(self, call: Call) -> Reply:
        """The reply. Register what cancels the work with `call.hooks.on_end(cancel)`: it returns False
        when the call has ended already (then cancel at once)."""
        ...

    def stream(self, call: Call) -> Iterator[Reply]:
        """Replies in order. The iterator's `close()`, where it has one, may be called from another
        thread while a reply is being made: it asks the work to stop, and the iteration then ends."""
        ...


class OnThreads:
    """A `Backend` over a `BlockingBackend`: each call on a thread of its own pool (one per admitted
    call: the front end admits at most `workers` at once)."""

    def __init__(self, backend: BlockingBackend, workers: int):
        self.backend = backend
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="cascade-call")

    async def call(self, call: Call) -> Reply:
        """The backend's call on a worker; a caller cancelled meanwhile ends the call (the backend's
        cancel) and waits for the thread, whose worker is not free before it is done."""
        thread = asyncio.wrap_future(self.pool.submit(self.backend.call, call))
        try:
            return await asyncio.shield(thread)
        except asyncio.CancelledError:
            call.hooks.end()
            await asyncio.wait([thread])
            raise

    async def stream(self, call: Call) -> AsyncGenerator[Reply, None]:
        """One worker thread iterates the backend's stream and hands each reply to the event loop; a
        consumer that leaves early ends the call (its hooks close the stream) and waits for the thread."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Reply | BaseException | None] = asyncio.Queue()

        def pump() -> None:
            try:
                replies = self.backend.stream(call)
                close = getattr(replies, "close", None)
                if close is not None and not call.hooks.on_end(close):
                    close()
                for reply in replies:
                    loop.call_soon_threadsafe(queue.put_nowait, reply)
                    if call.hooks.ended:
                        break
                loop.call_soon_threadsafe(queue.put_nowait, None)
            except BaseException as exc:
                loop.call_soon_threadsafe(queue.put_nowait, exc)

        thread = asyncio.wrap_future(self.pool.submit(pump))
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            call.hooks.end()  # a consumer that leaves early stops the backend's stream
            await asyncio.wait([thread])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def transport_failure(exc: Exception) -> Reply:
    """The status of a call a blocking backend could not deliver. A message the transport refuses for
    its size is RESOURCE_EXHAUSTED (retrying it cannot help); anything else is UNAVAILABLE with a retry
    hint (the coordinator restarting, or gone)."""
    code = getattr(exc, "code", None)  # grpc.aio.AioRpcError, from Serve's direct transport
    if callable(code) and code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "RESOURCE_EXHAUSTED", f"{TOO_LARGE}: the coordinator's transport refused it ({exc.details()})", b""  # type: ignore[attr-defined]
    return "UNAVAILABLE", f"coordinator unavailable ({type(exc).__name__}); retry", b""
