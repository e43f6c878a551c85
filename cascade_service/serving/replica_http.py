"""The OpenAI-compatible HTTP API inside a coordinator replica, for Ray Serve's HTTP proxy.

On a cluster, clients reach the app through Ray Serve's proxies: gRPC calls the coordinator's methods
by name, HTTP goes to the ASGI app the coordinator serves as its ingress (`serve.ingress`), as Ray Serve
LLM serves its OpenAI router. That app is `api.openai_http`'s, over a `Frontend` whose backend is the
replica itself: the front end's worker threads hand each call to the coordinator's `rpc` / `rpc_stream`
on the replica's event loop, where its decodes run. Admission (API keys, per-key limits, workers and
queue) is the same code the standalone server and the edge run, sized by `serving.admission`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol

from ..api.admission import Limits
from ..api.backend import Reply
from ..api.frontend import Frontend
from ..api.openai_http import http_options
from ..rpc.auth import ApiKeys


class Coordinator(Protocol):
    def rpc(self, method: str, body: bytes, owner: str = "") -> Awaitable[Reply]: ...

    def rpc_stream(self, method: str, body: bytes, owner: str = "") -> AsyncIterator[Reply]: ...


class ReplicaBackend:
    """A `Backend` that runs each call on the replica's loop and waits for it on a worker thread."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the app on its first request

    def call(
        self,
        method: str,
        body: bytes,
        timeout_s: float | None,
        owner: str = "",
        on_end: Callable[[Callable[[], None]], bool] | None = None,
    ) -> Reply:
        future = asyncio.run_coroutine_threadsafe(self._call(method, body, owner), self._loop())
        # A client that hangs up cancels the decode's task: it stops at its next round, freeing its caches.
        if on_end is not None and not on_end(lambda: _cancel(future)):
            future.cancel()
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return "DEADLINE_EXCEEDED", f"{method}: deadline exceeded", b""
        except concurrent.futures.CancelledError:
            return "CANCELLED", f"{method}: cancelled by the client", b""

    async def _call(self, method: str, body: bytes, owner: str) -> Reply:
        return await self.coordinator.rpc(method, body, owner)

    def stream(self, method: str, body: bytes, timeout_s: float | None, owner: str = "") -> Iterator[Reply]:
        return _LoopStream(self.coordinator.rpc_stream(method, body, owner), self._loop())

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            raise RuntimeError("the replica's HTTP app has not taken a request yet")
        return self.loop


def _cancel(future: concurrent.futures.Future) -> None:
    future.cancel()


class _LoopStream:
    """An async generator on another thread's loop, iterated from this thread; close() cancels it."""

    def __init__(self, replies: AsyncIterator[Reply], loop: asyncio.AbstractEventLoop):
        self.replies, self.loop = replies, loop
        self.pending: concurrent.futures.Future | None = None
        self.closed = False

    def __iter__(self) -> _LoopStream:
        return self

    def __next__(self) -> Reply:
        if self.closed:
            raise StopIteration
        self.pending = asyncio.run_coroutine_threadsafe(self._next(), self.loop)
        if self.closed:  # closed while the step was being scheduled
            self.pending.cancel()
        try:
            return self.pending.result()
        except (StopAsyncIteration, concurrent.futures.CancelledError):
            self.closed = True
            raise StopIteration from None

    async def _next(self) -> Reply:
        return await anext(self.replies)

    def close(self) -> None:
        # Cancelling the step in flight throws CancelledError into the generator at the await it waits
        # on (the decode's next round), which ends it; between steps, closing it does the same.
        if self.closed:
            return
        self.closed = True
        pending = self.pending
        if pending is not None and not pending.done():
            pending.cancel()
        else:
            aclose = getattr(self.replies, "aclose", None)
            if aclose is not None:
                asyncio.run_coroutine_threadsafe(aclose(), self.loop)


def replica_app(
    coordinator: Coordinator, model: str, tokenizer: Any, limits: Limits, api_keys: ApiKeys | None
) -> tuple[Any, Frontend]:
    """The ASGI app a coordinator replica serves, and its front end (whose `drain` a stop calls)."""
    backend = ReplicaBackend(coordinator)
    frontend = Frontend(backend, limits, api_keys, serving=True)
    app = http_options(0, model, tokenizer).app(frontend)

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if backend.loop is None:
            backend.loop = asyncio.get_running_loop()  # the loop the coordinator's calls run on
        await app(scope, receive, send)

    return asgi, frontend
