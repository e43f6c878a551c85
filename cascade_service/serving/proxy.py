"""cascade.v1.CascadeService on Ray Serve's gRPC proxy, with the rich error details on every call.

Ray's proxy forwards a unary call's trailing metadata from the replica, but a streaming call that
fails reaches it as a raised error, from which it takes only the code and the message. This
`grpc_servicer_functions` entry registers the service and wraps the proxy's handlers for it so that
a call ending in an error without the details trailer gets it, built from that code and message
(`api.status.rich_status`, the same bytes every other front end sends).

It also tells a stop when Ray's proxies have written every drained call's status (`wait_for_proxies`).
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ..api.status import DETAILS_KEY, code_of, rich_status
from ..proto.v1 import cascade_pb2_grpc


def add_cascade_service(servicer: Any, server: Any) -> None:
    """Register CascadeService on `server`; on Ray's proxy server (it builds each handler with its
    `service_handler_factory`), with the details trailer added where a call ends without one."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:  # any other server: the plain registration
        cascade_pb2_grpc.add_CascadeServiceServicer_to_server(servicer, server)
        return
    _lost_replicas_are_unavailable()
    server.service_handler_factory = _with_details(factory)
    try:
        cascade_pb2_grpc.add_CascadeServiceServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory  # other services' handlers stay Ray's own


REPLICA_LOST = "the replica serving this call was lost ({}); retry the request"


def _lost_replicas_are_unavailable() -> None:
    """Ray's proxy reports a call whose replica died under it (its node lost, its process killed) as
    INTERNAL, with Ray's message. The call did not complete and a retry reaches a live replica (a session
    is in Redis, so nothing is lost): that is UNAVAILABLE, with a retry hint. The proxy maps exceptions
    to statuses in one function, imported by name into ray.serve._private.proxy; this wraps it there,
    in the proxy's process (where Serve calls this registration), for the actor-death errors only: an
    error raised by the replica's code (RayTaskError) keeps Serve's mapping."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve._private import proxy
    from ray.serve._private.proxy_request_response import ResponseStatus

    original = proxy.get_grpc_response_status
    if getattr(original, "cascade_mapped", False):
        return

    def status(exc: BaseException, request_timeout_s: float | None, request_id: str) -> Any:
        if isinstance(exc, RayActorError) and not isinstance(exc, RayTaskError):
            why = type(exc).__name__
            return ResponseStatus(code=grpc.StatusCode.UNAVAILABLE, is_error=True, message=REPLICA_LOST.format(why))
        return original(exc, request_timeout_s, request_id)

    status.cascade_mapped = True  # type: ignore[attr-defined]  # a mark on a function object
    proxy.get_grpc_response_status = status


def _with_details(factory: Callable[..., Any]) -> Callable[..., Any]:
    def make(service_method: str, streaming_type: Any) -> Any:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if inspect.isasyncgenfunction(handler):

            async def streaming(request: Any, context: Any) -> AsyncIterator[Any]:
                async for message in handler(request, context):
                    yield message
                add_details(context)

            return streaming

        async def unary(request: Any, context: Any) -> Any:
            response = await handler(request, context)
            add_details(context)
            return response

        return unary

    return make


def add_details(context: Any) -> None:
    """The details trailer for a call that ends in an error and lacks one (grpc's asyncio context)."""
    code = code_of(context.code())
    if code is None or code == grpc.StatusCode.OK:
        return
    trailing = tuple(context.trailing_metadata() or ())
    if any(key == DETAILS_KEY for key, _ in trailing):
        return
    details = rich_status(code, context.details() or "").SerializeToString()
    context.set_trailing_metadata((*trailing, (DETAILS_KEY, details)))


# Ray's proxy says it is drained once it holds no call and has drained for this long (30 s by default:
# a node an autoscaler removes keeps taking stragglers). A local Ray started by `serve` sets it short
# (`short_proxy_drain`, before ray.init: the proxy's process reads it at import) so a stop learns
# the moment the proxy has no call left, instead of guessing how long forwarding the drained calls'
# statuses takes.
MIN_DRAINING_ENV = "RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S"


def short_proxy_drain() -> None:
    os.environ.setdefault(MIN_DRAINING_ENV, "0.01")  # Ray reads a positive number; an operator's wins


def wait_for_proxies(timeout_s: float) -> bool:
    """Drain Ray's proxies and wait until none holds a call (its status written to the client): True,
    or False once timeout_s passed. Called once the coordinator has ended its calls (their statuses
    are then on their way through the proxy); tearing Ray down before that turned them into CANCELLED
    ("client disconnected": the proxy cancels what it still forwards when its app or process goes)."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE, SERVE_PROXY_NAME

    deadline = time.monotonic() + timeout_s
    proxies = [
        ray.get_actor(actor["name"], namespace=SERVE_NAMESPACE)
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == SERVE_NAMESPACE and actor["name"].startswith(SERVE_PROXY_NAME)
    ]
    ray.get([proxy.update_draining.remote(True) for proxy in proxies], timeout=timeout_s)
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        if all(ray.get([proxy.is_drained.remote() for proxy in proxies], timeout=left + 0.5)):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
