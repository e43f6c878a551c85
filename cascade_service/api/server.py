"""The standalone gRPC server (no Ray): the CascadeService servicer behind the asyncio front end.

The embedded wiring for one process; `serving.app` is the Ray Serve wiring of the same servicer. The
front end (`api.frontend`) takes each call (keys, limits, the body, health, reflection) and hands an
admitted one to `LocalBackend`, which runs the servicer as a task of the process's engine loop
(scheduling.loop), where its decode shares every model's batched passes with the other requests; the
front end's worker only waits for the reply, or for each streamed chunk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..coordinator import Coordinator
from ..rpc.auth import ApiKeys, TlsFiles
from ..scheduling.loop import EngineLoop
from .admission import Limits
from .backend import RecordingContext, Reply, request_type
from .frontend_server import FrontendServer, HttpOptions, start_frontend
from .servicer import CascadeServicer

# Calls beyond the workers wait for one, up to this many; past that a call gets RESOURCE_EXHAUSTED
# (as Serve's max_queued_requests does) instead of memory and latency growing without limit.
MAX_QUEUED_RPCS = 64


class LocalBackend:
    """The front end's `Backend` for a coordinator in this process: the servicer in the engine loop,
    its decode stopped at the next round once the client is gone or past its deadline."""

    def __init__(self, servicer: CascadeServicer, loop: EngineLoop):
        self.servicer = servicer
        self.loop = loop

    def call(
        self,
        method: str,
        body: bytes,
        timeout_s: float | None,
        owner: str = "",
        on_end: Callable[[Callable[[], None]], bool] | None = None,
    ) -> Reply:
        gone = threading.Event()
        if on_end is not None and not on_end(gone.set):
            gone.set()
        deadline = _deadline(timeout_s)
        context = RecordingContext(owner, _cancelled(gone, deadline))
        request = request_type(method).FromString(body)
        if method == "Generate":
            response = self.loop.run(self.servicer.Generate, request, context, context.cancelled)
        else:
            response = self.loop.run(getattr(self.servicer, method), request, context)
        return (*_status(context, gone, deadline, method), response.SerializeToString())

    def stream(self, method: str, body: bytes, timeout_s: float | None, owner: str = "") -> _LocalStream:
        request = request_type(method).FromString(body)
        return _LocalStream(self.servicer, self.loop, method, request, owner, timeout_s)


class _LocalStream:
    """GenerateStream's replies, made in the engine loop; its status (when the servicer set one) comes
    as the last reply."""

    def __init__(
        self,
        servicer: CascadeServicer,
        loop: EngineLoop,
        method: str,
        request: Any,
        owner: str,
        timeout_s: float | None,
    ):
        self._gone = threading.Event()
        self._method, self._deadline = method, _deadline(timeout_s)
        self._context = RecordingContext(owner, _cancelled(self._gone, self._deadline))
        stream = getattr(servicer, method)
        self._chunks = loop.iterate(lambda: stream(request, self._context, self._context.cancelled))
        self._done = False

    def __iter__(self) -> Iterator[Reply]:
        return self

    def __next__(self) -> Reply:
        if self._done:
            raise StopIteration
        try:
            return "OK", "", next(self._chunks).SerializeToString()
        except StopIteration:
            self._done = True
            if self._context.code.name != "OK":
                return (*_status(self._context, self._gone, self._deadline, self._method), b"")
            raise

    def close(self) -> None:
        """Stop the decode: at once when called between replies; from another thread while a reply is
        being made, at its next round (the iterating thread then closes the generator)."""
        self._gone.set()
        try:
            self._chunks.close()
        except ValueError:  # "generator already executing": the decode sees the cancel and ends
            pass


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _cancelled(gone: threading.Event, deadline: float | None) -> Callable[[], bool]:
    return lambda: gone.is_set() or (deadline is not None and time.monotonic() > deadline)


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
