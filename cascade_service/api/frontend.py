"""The asyncio gRPC front end of the standalone server and the edge: admission before work.

A call costs a worker (a decode in the engine loop, or a thread that waits on a remote coordinator) only
once it is admitted, and it is admitted only after
1. its headers carry a known API key, when keys are configured. This is checked before the body is
   read, so a call without a key is refused at once, whatever it sends afterwards;
2. its key has fewer than `max_calls_per_key` calls open;
3. its body arrived within `body_timeout_s` and decodes (INVALID_ARGUMENT naming the field, never the
   INTERNAL grpcio answers for bytes it cannot deserialize);
4. a worker is free, or fewer than `max_queued` admitted calls wait for one (RESOURCE_EXHAUSTED).
Until then a call is a coroutine on one event loop, not a thread. At most `max_pending` calls wait for
their bodies at once, and each connection carries at most `max_streams_per_connection` calls (HTTP/2's
own limit, which the client's transport respects). The body is decoded once, here: the backend is
handed the message (and the bytes, for a backend that forwards them to another process). Health and
reflection are answered on the loop and never wait for a worker, and they have a bound of their own
(`max_probes` open at once), so a probe answers while every worker is busy and the service's calls are
at their bounds.

To take the body in our own code, every method is registered as request-streaming with raw bytes (the
wire is the same for a unary request: one message, then the half-close), so the handler runs as soon
as the headers arrive.

Behind the front end is a `Backend` (`api.backend`), awaited on this event loop: the coordinator in this
process (`api.server.LocalBackend`: its decode a task of the engine loop, no thread between), or the
coordinator deployment behind a Ray Serve handle (`serving.local.HandleBackend`, on worker threads:
`api.blocking.OnThreads`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection as reflection_v1alpha
from grpc_reflection.v1alpha import reflection_pb2

from ..metrics import default_metrics
from ..rpc.auth import ApiKeys, authenticate
from ..rpc.reflection import METHOD as REFLECTION_METHOD
from ..rpc.reflection import SERVICES, V1, V1ALPHA, advertised
from .admission import CallHooks, Limits, Refused, Workers, abort, decode_body, time_left
from .backend import STREAMING, UNARY, Backend, Call, Reply, payload_bytes, request_type
from .health import HEALTH_SERVICES, status_reply, watch_reply
from .servicer import SERVICE_NAME
from .status import STOPPING

log = logging.getLogger(__name__)

HEALTH = "grpc.health.v1.Health"


class Frontend:
    """The handlers and the admission state of one server; all of its state lives on the server's loop."""

    def __init__(self, backend: Backend, limits: Limits, api_keys: ApiKeys | None, serving: bool):
        self.backend = backend
        self.limits = limits
        self.api_keys = api_keys
        self.serving = serving
        self.stopping = False
        self.workers = Workers(limits)
        self._pending = 0
        self._per_key: Counter[str] = Counter()
        self._probes = 0
        self._calls: set[CallHooks] = set()
        self._changed: asyncio.Event | None = None  # set when `serving` changes (health Watch)
        self._reflection = reflection_v1alpha.aio.ReflectionServicer(advertised(SERVICES))

    # --- the handlers -------------------------------------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        cascade = {m: grpc.stream_unary_rpc_method_handler(functools.partial(self._unary, m)) for m in UNARY}
        cascade.update(
            {m: grpc.stream_stream_rpc_method_handler(functools.partial(self._stream, m)) for m in STREAMING}
        )
        health = {
            "Check": grpc.stream_unary_rpc_method_handler(self._check),
            "Watch": grpc.stream_stream_rpc_method_handler(self._watch),
        }
        reflect = grpc.stream_stream_rpc_method_handler(self._reflect)
        return [
            grpc.method_handlers_generic_handler(SERVICE_NAME, cascade),
            grpc.method_handlers_generic_handler(HEALTH, health),
            grpc.method_handlers_generic_handler(V1ALPHA, {REFLECTION_METHOD: reflect}),
            grpc.method_handlers_generic_handler(V1, {REFLECTION_METHOD: reflect}),
        ]

    async def _unary(self, method: str, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        try:
            with self.open_call(context.invocation_metadata()) as owner:
                message, body = await self._body(requests, request_type(method))
                call = Call(method, message, owner, time_left(context), CallHooks(), body)
                async with self.admitted(call.hooks):
                    code, details, payload = await self.run(call)
                if call.hooks.stopped:
                    code, details = "UNAVAILABLE", STOPPING
                if code != "OK":
                    raise Refused(grpc.StatusCode[code], details)
                return payload_bytes(payload)
        except Refused as refused:
            default_metrics().refused(refused.code.name)
            await abort(context, refused.code, refused.message)
        raise AssertionError("unreachable: abort raises")  # pragma: no cover

    async def _stream(
        self, method: str, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        try:
            with self.open_call(context.invocation_metadata()) as owner:
                message, body = await self._body(requests, request_type(method))
                call = Call(method, message, owner, time_left(context), CallHooks(), body)
                # closed here, not when collected: an error status ends the backend's work before the call does
                async with self.admitted(call.hooks), contextlib.aclosing(self.replies(call)) as replies:
                    async for code, details, payload in replies:
                        if call.hooks.stopped:
                            code, details = "UNAVAILABLE", STOPPING
                        if code != "OK":
                            raise Refused(grpc.StatusCode[code], details)
                        yield payload_bytes(payload)
                    if call.hooks.stopped:  # the backend ended quietly when the stop cancelled it
                        raise Refused(grpc.StatusCode.UNAVAILABLE, STOPPING)
        except Refused as refused:
            default_metrics().refused(refused.code.name)
            await abort(context, refused.code, refused.message)

    async def _check(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        try:
            with self._probe_slot():
                request = await self._probe(requests)
            if request.service not in HEALTH_SERVICES:
                raise Refused(grpc.StatusCode.NOT_FOUND, "service: not served here")
            return status_reply(self._is_serving()).SerializeToString()
        except Refused as refused:
            await abort(context, refused.code, refused.message)
        raise AssertionError("unreachable: abort raises")  # pragma: no cover

    async def _watch(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            with self._probe_slot():
                request = await self._probe(requests)
                last = None
                while True:
                    changed = self._changed_event()  # taken first: a change while a reply is written is not missed
                    reply = watch_reply(request.service, self._is_serving())
                    if reply != last:
                        yield reply.SerializeToString()
                        last = reply
                    await changed.wait()
        except Refused as refused:
            await abort(context, refused.code, refused.message)

    async def _reflect(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Reflection (v1 and v1alpha share the wire format): each request decoded here and within
        body_timeout_s of the last answer, so an idle stream does not stay open for good."""
        try:

            async def decoded() -> AsyncIterator[Any]:
                iterator = aiter(requests)
                while True:
                    raw = await self._next(iterator)
                    if raw is None:
                        return
                    yield decode_body(reflection_pb2.ServerReflectionRequest, raw)

            with self._probe_slot():
                async for response in self._reflection.ServerReflectionInfo(decoded(), context):
                    yield response.SerializeToString()
        except Refused as refused:
            await abort(context, refused.code, refused.message)

    # --- admission ---------------------------------------------------------------------------------

    def _authenticate(self, metadata: Any) -> str:
        if self.api_keys is None:
            return ""
        owner, message = authenticate(self.api_keys, metadata)
        if owner is None:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, message)
        return owner

    @contextlib.contextmanager
    def open_call(self, metadata: Any) -> Iterator[str]:
        """The caller's owner id (its key from `metadata`), counted against the key's limit while open."""
        if self.stopping:
            raise Refused(grpc.StatusCode.UNAVAILABLE, STOPPING)
        owner = self._authenticate(metadata)
        if self.api_keys is not None and self._per_key[owner] >= self.limits.max_calls_per_key:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this API key has {self.limits.max_calls_per_key} calls open, its limit; retry later",
            )
        self._per_key[owner] += 1
        try:
            yield owner
        finally:
            self._per_key[owner] -= 1
            if self._per_key[owner] <= 0:
                del self._per_key[owner]

    @contextlib.contextmanager
    def _probe_slot(self) -> Iterator[None]:
        """A health or reflection call, open: bounded apart from the service's calls, so that probes
        answer while those are at their bounds."""
        if self._probes >= self.limits.max_probes:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.limits.max_probes} health and reflection calls are open; retry later",
            )
        self._probes += 1
        try:
            yield
        finally:
            self._probes -= 1

    async def _body(self, requests: AsyncIterator[bytes], kind: Any) -> tuple[Any, bytes]:
        """A service call's request, decoded once (bytes that are no `kind` never reach a backend), and
        its bytes; counted against max_pending while they arrive."""
        if self._pending >= self.limits.max_pending:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.limits.max_pending} calls are waiting for their request; retry later",
            )
        self._pending += 1
        try:
            body = await self._message(requests)
        finally:
            self._pending -= 1
        return decode_body(kind, body), body

    async def _probe(self, requests: AsyncIterator[bytes]) -> Any:
        """A health call's request (bounded by the probe slot its caller holds, not by max_pending)."""
        return decode_body(health_pb2.HealthCheckRequest, await self._message(requests))

    async def _message(self, requests: AsyncIterator[bytes]) -> bytes:
        """The one message of a unary-request call, and the client's half-close after it."""
        iterator = aiter(requests)
        body = await self._next(iterator)
        if body is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "request: the call ended without a request message")
        if await self._next(iterator) is not None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "request: this method takes one request message")
        return body

    async def _next(self, iterator: AsyncIterator[bytes]) -> bytes | None:
        """The next message, None at the client's half-close; DEADLINE_EXCEEDED past body_timeout_s."""
        try:
            return await asyncio.wait_for(anext(iterator), self.limits.body_timeout_s)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request: the message did not arrive within {self.limits.body_timeout_s:g} s",
            ) from None

    @contextlib.asynccontextmanager
    async def admitted(self, call: CallHooks) -> AsyncIterator[None]:
        """A worker (or a place in the queue for one) for an admitted call, which a drain can cancel.
        The worker itself is given back when the backend's work has ended (`run`, `replies`)."""
        if self.stopping:
            raise Refused(grpc.StatusCode.UNAVAILABLE, STOPPING)
        self._calls.add(call)
        try:
            began = time.monotonic()
            await self.workers.take()
            default_metrics().queue.observe(time.monotonic() - began)
            yield
        finally:
            self._calls.discard(call)

    # --- running on a worker ---------------------------------------------------------------------------

    async def run(self, call: Call) -> Reply:
        """The backend's reply, awaited on this loop. A caller cancelled meanwhile (the client hung up,
        its deadline passed) ends the call; the worker is given back once the backend's work has ended."""
        try:
            return await self.backend.call(call)
        except asyncio.CancelledError:
            call.hooks.end()
            raise
        finally:
            self.workers.release()

    async def replies(self, call: Call) -> AsyncGenerator[Reply, None]:
        """A stream's replies from the backend. Ending early (the client gone, an error) ends the call,
        which stops the backend's work; the worker is given back once that work has ended."""
        replies = self.backend.stream(call)
        try:
            async for reply in replies:
                yield reply
        except Exception as exc:
            log.error("a stream's backend failed", exc_info=exc)
            raise Refused(
                grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"
            ) from None
        finally:
            call.hooks.end()
            try:
                await replies.aclose()
            finally:
                self.workers.release()

    # --- health and stopping ------------------------------------------------------------------------------

    def _is_serving(self) -> bool:
        return self.serving and not self.stopping

    def _changed_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def set_serving(self, serving: bool) -> None:
        """On the loop: health answers SERVING or NOT_SERVING, and every Watch hears of a change."""
        self.serving = serving
        self._notify()

    def _notify(self) -> None:
        event = self._changed_event()
        event.set()
        self._changed = asyncio.Event()  # watchers wait on the next change

    async def drain(self, grace_s: float) -> int:
        """Stop taking calls (UNAVAILABLE; health NOT_SERVING), give those running grace_s, then cancel
        the rest: each ends UNAVAILABLE, saying the server is stopping. Returns how many were cancelled."""
        self.stopping = True
        self._notify()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(grace_s, 0.0)
        while self._calls and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._calls)
        for call in left:
            call.end(stopped=True)
        # Each cancelled call ends with its status before the server goes (bounded: a backend that does
        # not notice its cancel is cut off by the server's stop).
        bound = loop.time() + 5.0
        while self._calls and loop.time() < bound:
            await asyncio.sleep(0.02)
        return len(left)
