"""A running front end (`api.frontend.Frontend`) on an event loop of its own, driven from synchronous code."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from ..rpc.auth import ApiKeys, TlsFiles, bind
from .admission import Limits
from .backend import Backend
from .frontend import Frontend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpOptions:
    """The HTTP API beside gRPC: its port (0 picks one) and its app, made for the front end."""

    port: int
    app: Callable[[Frontend], Any]


class FrontendServer:
    """A running front end: a `grpc.aio` server on an event loop of its own (a daemon thread), driven
    from synchronous code. `stop(grace)` drains as `Frontend.drain` does and returns an event that is
    set once the server has stopped (as `grpc.Server.stop` does)."""

    def __init__(
        self,
        backend: Backend,
        host: str,
        port: int,
        limits: Limits,
        api_keys: ApiKeys | None,
        tls: TlsFiles | None,
        serving: bool,
        http: HttpOptions | None = None,
    ):
        self.frontend = Frontend(backend, limits, api_keys, serving)
        self.http_port: int | None = None
        self._http: Any = None  # the uvicorn server of the HTTP API, on this loop
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="cascade-frontend", daemon=True)
        self._thread.start()
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopping = False
        try:
            self.server, self.port = self._await(self._start(host, port, limits, tls))
            if http is not None:
                self.http_port = self._await(self._start_http(host, http, tls))
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise

    async def _start(self, host: str, port: int, limits: Limits, tls: TlsFiles | None) -> tuple[Any, int]:
        options = [
            ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
            ("grpc.max_receive_message_length", limits.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers(self.frontend.handlers())
        bound = bind(server, host, port, tls)
        await server.start()
        return server, bound

    async def _start_http(self, host: str, http: HttpOptions, tls: TlsFiles | None) -> int:
        """The HTTP API (api.openai_http) on host:http.port, on this loop: its calls share the gRPC
        calls' admission. Returns the bound port."""
        import uvicorn

        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        # proto named, not left 0: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP,
        # and accepted sockets inherit it. Without it a reused keep-alive connection waits out the
        # client's delayed ACK (40 ms) between a reply's headers and its body.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), http.port))
        sock.listen(128)
        sock.setblocking(False)
        config = uvicorn.Config(
            http.app(self.frontend),
            log_level="warning",
            lifespan="off",
            access_log=False,
            ssl_certfile=tls.cert_file if tls else None,
            ssl_keyfile=tls.key_file if tls else None,
        )
        self._http = uvicorn.Server(config)
        self._http_task = asyncio.ensure_future(self._http.serve(sockets=[sock]))
        while not self._http.started and not self._http_task.done():
            await asyncio.sleep(0.01)
        if self._http_task.done():
            self._http_task.result()  # raises what stopped it
        return int(sock.getsockname()[1])

    def _await(self, coroutine: Any, timeout_s: float | None = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def set_serving(self, serving: bool) -> None:
        self.loop.call_soon_threadsafe(self.frontend.set_serving, serving)

    def stop(self, grace: float | None = None) -> threading.Event:
        """Drain for `grace` seconds (None: end calls at once), stop the server and its loop."""
        with self._stop_lock:
            if self._stopping:
                return self._stopped
            self._stopping = True
        try:
            self._await(self._stop(grace or 0.0), timeout_s=(grace or 0.0) + 30.0)
        except Exception:
            log.exception("the front end did not stop cleanly")
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.frontend.backend.close()
            self._stopped.set()
        return self._stopped

    async def _stop(self, grace_s: float) -> None:
        await self.frontend.drain(grace_s)
        if self._http is not None:
            self._http.should_exit = True
            await asyncio.wait({self._http_task}, timeout=5.0)
        await self.server.stop(1.0)


def start_frontend(
    backend: Backend,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: Limits | None = None,
    api_keys: ApiKeys | None = None,
    tls: TlsFiles | None = None,
    serving: bool = True,
    http: HttpOptions | None = None,
) -> FrontendServer:
    """Serve CascadeService, health and reflection for `backend` on host:port (port 0 picks one).

    api_keys: when given, every CascadeService call needs one of them (`rpc.auth`; health and
    reflection stay open); tls: serve TLS; serving: what health answers until `set_serving` changes it.
    """
    return FrontendServer(backend, host, port, limits or Limits(), api_keys, tls, serving, http)
