"""A tier as a gRPC service of its own: cascade.tier.v1.Tier over a `TierGroup` (`cascade-service tier`).

The server is a `grpc.aio` server on an event loop of its own. A call is checked there (its API key,
its deadline, the queue) and only then handed to the process's engine loop (engine.loop) as a task,
so idle, unauthenticated or refused calls cost nothing there. Concurrent calls share forward passes:
the engine loop batches every waiting call's passes of each model, as a Ray tier replica does.

Status codes: a malformed or out-of-range call is INVALID_ARGUMENT naming the field, a tier this
server does not host NOT_FOUND, a call without a valid key UNAUTHENTICATED, a full queue
RESOURCE_EXHAUSTED, a call whose deadline passed while it waited DEADLINE_EXCEEDED, a server that is
stopping UNAVAILABLE. None of them stops the server. Health (grpc.health.v1) and reflection are served.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from ..engine.loop import TaskLoop
from ..proto.tier.v1 import tier_pb2 as pb
from ..rpc.auth import ApiKeys, TlsFiles, bearer, bind
from ..rpc.reflection import enable_reflection
from ..transport.wire import MAX_MESSAGE_BYTES, SERVICE
from .host import UnknownTier

log = logging.getLogger(__name__)

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
DEFAULT_WORKERS = 64  # calls at work at once in the engine loop (their passes batch)
DEFAULT_MAX_QUEUED = 256  # calls beyond those; past both, RESOURCE_EXHAUSTED


class Served(Protocol):
    """What a tier server serves: encoded calls in, encoded replies out (`tierhost.group.TierGroup`)."""

    mag_vocab: int | None
    loop: TaskLoop  # where its calls run (its engine core's: engine.core)

    def draft(self, data: bytes) -> bytes: ...

    def review(self, data: bytes) -> bytes: ...

    def release(self, data: bytes) -> bool: ...

    def info(self) -> pb.InfoReply: ...

    def close(self) -> None: ...


class TierService:
    """cascade.tier.v1.Tier's methods over `group`, as raw-bytes handlers (the group decodes)."""

    def __init__(
        self,
        group: Served,
        api_keys: ApiKeys | None = None,
        workers: int = DEFAULT_WORKERS,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ):
        self.group = group
        self.api_keys = api_keys
        self.engine = group.loop  # where the group's models run their passes
        self.capacity = workers + max_queued
        self.in_flight = 0  # on the loop only
        self.stopping = False

    def handlers(self) -> grpc.GenericRpcHandler:
        def method(call: Callable[[bytes], bytes]) -> grpc.RpcMethodHandler:
            async def handle(data: bytes, context: grpc.aio.ServicerContext) -> bytes:
                return await self._serve(call, data, context)

            # No (de)serializers: the bytes go to the group as they came, and come back as it made them.
            return grpc.unary_unary_rpc_method_handler(handle)

        methods = {
            "Draft": method(self.group.draft),
            "Review": method(self.group.review),
            "Release": method(self._release),
            "Info": method(self._info),
        }
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    async def _serve(self, call: Callable[[bytes], bytes], data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if self.api_keys is not None and self.api_keys.check(bearer(context.invocation_metadata())) is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: a valid API key is required")
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tier server is stopping; retry on another replica")
        if self.in_flight >= self.capacity:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.capacity} calls are open; retry later")
        self.in_flight += 1
        try:
            code, message, reply = await self.engine.arun(_guarded, call, data, context.time_remaining())
        finally:
            self.in_flight -= 1
        if code is not None:
            await context.abort(code, message)
        return reply

    def _release(self, data: bytes) -> bytes:
        return pb.ReleaseReply(held=self.group.release(data)).SerializeToString()

    def _info(self, data: bytes) -> bytes:
        pb.InfoRequest.FromString(data)  # an InfoRequest has no fields; bytes that are not one fail here
        return self.group.info().SerializeToString()


def _guarded(call: Callable[[bytes], bytes], data: bytes, remaining: float | None) -> tuple[Any, str, bytes]:
    """Run a call (an engine loop task): (None, "", reply), or (status code, message, b"") for one that fails."""
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed while it waited", b""
    try:
        return None, "", call(data)
    except UnknownTier as exc:
        return grpc.StatusCode.NOT_FOUND, str(exc), b""
    except DecodeError as exc:
        return grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {exc}", b""
    except (ValueError, TypeError) as exc:
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), b""
    except Exception as exc:
        log.exception("tier call failed")
        return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the tier server's log", b""


class TierServer:
    """A running tier server: `port` is the bound one; `stop(grace)` ends it."""

    def __init__(self, service: TierService, host: str, port: int, tls: TlsFiles | None, reuse_port: bool = False):
        self.service = service
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tier-server", daemon=True)
        self._thread.start()
        self.health = health_aio.HealthServicer()
        self._stop_lock = threading.Lock()
        self._stopped = False
        try:
            self.server, self.port = self._await(self._start(host, port, tls, reuse_port))
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise

    async def _start(self, host: str, port: int, tls: TlsFiles | None, reuse_port: bool) -> tuple[grpc.aio.Server, int]:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Off, so a port in use fails loudly; on for a Ray tier deployment's replicas, which share
            # their node's port (the kernel spreads connections over them).
            ("grpc.so_reuseport", int(reuse_port)),
        ]
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((self.service.handlers(),))
        from grpc_health.v1 import health_pb2_grpc

        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection(server, [SERVICE, HEALTH])
        bound = bind(server, host, port, tls)
        await server.start()
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return server, bound

    def _await(self, coroutine: Any, timeout_s: float | None = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self, grace_s: float = 0.0) -> None:
        """Answer health NOT_SERVING and new calls UNAVAILABLE, let calls at work finish for `grace_s`.
        Stopping a stopped server does nothing."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True

        async def stop() -> None:
            self.service.stopping = True
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace_s)

        try:
            self._await(stop(), timeout_s=grace_s + 30.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.service.group.close()

    def wait(self) -> None:
        self._thread.join()


def start_tier_server(
    group: Any,  # tierhost.group.TierGroup, or any `Served`
    host: str = "127.0.0.1",
    port: int = 0,
    api_keys: ApiKeys | None = None,
    tls: TlsFiles | None = None,
    workers: int = DEFAULT_WORKERS,
    max_queued: int = DEFAULT_MAX_QUEUED,
    reuse_port: bool = False,
) -> TierServer:
    """Serve `group` on host:port (0 picks a free port), each model batching concurrent calls' passes
    in its engine core's loop."""
    return TierServer(TierService(group, api_keys, workers, max_queued), host, port, tls, reuse_port)
