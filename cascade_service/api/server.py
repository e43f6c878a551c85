"""The standalone gRPC server (no Ray): the CascadeService servicer behind the asyncio front end.

The embedded wiring for one process; `serving.app` is the Ray Serve wiring of the same servicer. The
front end (`api.frontend`) takes each call (keys, limits, the body, health, reflection), decodes its
request once, and hands the message to `LocalBackend`, which runs the servicer as a task of the
process's engine loop (engine.loop), where its decode shares every model's batched passes with the
other requests. The front end awaits the task on its own event loop (`TaskLoop.arun`, `aiterate`):
no thread waits between them, for the reply or for each streamed chunk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

from ..coordinator import Coordinator
from ..engine.loop import TaskLoop, task_cancelled
from ..rpc.auth import ApiKeys, TlsFiles
from .admission import Limits
from .backend import Call, RecordingContext, Reply
from .frontend_server import FrontendServer, HttpOptions, start_frontend
from .servicer import CascadeServicer

# Calls beyond the workers wait for one, up to this many; past that a call gets RESOURCE_EXHAUSTED
# (as Serve's max_queued_requests does) instead of memory and latency growing without limit.
MAX_QUEUED_RPCS = 64


class LocalBackend:
    """The front end's `Backend` for a coordinator in this process: the servicer in the engine loop,
    awaited on the front end's event loop; its decode stopped at the next round once the client is gone
    or past its deadline, or the server drains."""

    def __init__(self, servicer: CascadeServicer, loop: TaskLoop):
        self.servicer = servicer
        self.loop = loop

    async def call(self, call: Call) -> Reply:
        gone, deadline = _gone(call), _deadline(call.timeout_s)
        context = RecordingContext(call.owner, _cancelled(gone, deadline))
        if call.method == "Generate":
            response = await self.loop.arun(self.servicer.Generate, call.request, context, context.cancelled)
        else:
            response = await self.loop.arun(getattr(self.servicer, call.method), call.request, context)
        return (*_status(context, gone, deadline, call.method), response)

    async def stream(self, call: Call) -> AsyncGenerator[Reply, None]:
        """GenerateStream's chunks, made in the engine loop; its status (when the servicer set one) comes
        as the last reply."""
        gone, deadline = _gone(call), _deadline(call.timeout_s)
        context = RecordingContext(call.owner, _cancelled(gone, deadline))
        method = getattr(self.servicer, call.method)
        # an async generator (TaskLoop.aiterate), closed below
        chunks = cast(
            AsyncGenerator[Any, None], self.loop.aiterate(lambda: method(call.request, context, context.cancelled))
        )
        try:
            async for chunk in chunks:
                yield "OK", "", chunk
        finally:
            await chunks.aclose()  # a consumer that left early: the decode stops at its next round
        if context.code.name != "OK":
            yield (*_status(context, gone, deadline, call.method), b"")

    def close(self) -> None:
        """Nothing of its own: the engine loop is its engine core's."""


def _gone(call: Call) -> threading.Event:
    """Set when the call ends (the client hung up, the server drains): read by the decode, in the
    engine loop's thread, after each round."""
    gone = threading.Event()
    if not call.hooks.on_end(gone.set):
        gone.set()
    return gone


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _cancelled(gone: threading.Event, deadline: float | None) -> Callable[[], bool]:
    # task_cancelled: the awaiting coroutine itself was cancelled (TaskLoop.arun, aiterate tell the task)
    return lambda: gone.is_set() or task_cancelled() or (deadline is not None and time.monotonic() > deadline)


def _status(context: RecordingContext, gone: threading.Event, deadline: float | None, method: str) -> tuple[str, str]:
    """The call's code and message. A decode stopped by the client's deadline (not by a hang-up) ends
    DEADLINE_EXCEEDED, as gRPC itself ends such a call: this side may see the deadline first."""
    if context.code.name == "CANCELLED" and not gone.is_set() and deadline is not None and time.monotonic() > deadline:
        return "DEADLINE_EXCEEDED", f"{method}: deadline exceeded"
    return context.code.name, context.details


def start_server(
    coordinator: Coordinator,
    host: str = "127.0.0.1",
    port: int = 0,
    workers: int = 8,
    api_keys: ApiKeys | None = None,
    tls: TlsFiles | None = None,
    max_queued: int = MAX_QUEUED_RPCS,
    limits: Limits | None = None,
    http: HttpOptions | None = None,
) -> tuple[FrontendServer, int]:
    """Start serving `coordinator`, whose requests run in its engine loop (`coordinator.loop`: its
    engine core's); returns the server and the bound port (port 0 picks a free one).

    api_keys: when given, every CascadeService call needs one of them (`rpc.auth`); tls: serve TLS.
    workers calls run at once and max_queued more wait; past that a call gets RESOURCE_EXHAUSTED.
    `limits` sets these and the rest of admission (`api.admission.Limits`); it wins over both.
    http: also serve the HTTP API (`api.openai_http`) on its port, on the same admission.
    """
    limits = limits or Limits(workers=workers, max_queued=max_queued)
    if coordinator.loop is None:
        raise ValueError("coordinator.loop: a served coordinator runs its requests in its engine core's loop")
    server = start_frontend(
        LocalBackend(CascadeServicer(coordinator), coordinator.loop), host, port, limits, api_keys, tls, http=http
    )
    return server, server.port
