"""cascade.v1.CascadeService on Ray Serve's gRPC proxy, with the rich error details on every call.

Ray's proxy forwards a unary call's trailing metadata from the replica, but a streaming call that
fails reaches it as a raised error, from which it takes only the code and the message. This
`grpc_servicer_functions` entry registers the service and wraps the proxy's handlers for it so that
a call ending in an error without the details trailer gets it, built from that code and message
(`api.status.rich_status`, the same bytes every other front end sends).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from .status import DETAILS_KEY, code_of, rich_status
from .v1 import cascade_pb2_grpc


def add_cascade_service(servicer: Any, server: Any) -> None:
    """Register CascadeService on `server`; on Ray's proxy server (it builds each handler with its
    `service_handler_factory`), with the details trailer added where a call ends without one."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:  # any other server: the plain registration
        cascade_pb2_grpc.add_CascadeServiceServicer_to_server(servicer, server)
        return
    server.service_handler_factory = _with_details(factory)
    try:
        cascade_pb2_grpc.add_CascadeServiceServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory  # other services' handlers stay Ray's own


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
