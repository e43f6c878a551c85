"""serving/proxy.py on Ray Serve's own gRPC server class with a stand-in for the proxy's handler factory:
a CascadeService call that ends in an error without the details trailer gets the one every other
front end sends (api/status.rich_status); the services registered after it get Ray's factory back."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from ray.serve._private.grpc_util import gRPCGenericServer
from ray.serve._private.proxy_request_response import gRPCStreamingType

from cascade_service.api.status import DETAILS_KEY, rich_status
from cascade_service.proto.v1 import cascade_pb2_grpc
from cascade_service.serving.proxy import add_cascade_service

MESSAGE = "max_new_tokens must be in [1, 4096], got 0"


class AioContext:
    """What grpc.aio's servicer context offers the proxy's handlers: code() may be the number."""

    def __init__(self) -> None:
        self._code: Any = None
        self._details = ""
        self._trailing: tuple = ()

    def code(self) -> Any:
        return self._code

    def set_code(self, code: Any) -> None:
        self._code = code

    def details(self) -> str:
        return self._details

    def set_details(self, details: str) -> None:
        self._details = details

    def trailing_metadata(self) -> tuple:
        return self._trailing

    def set_trailing_metadata(self, metadata: tuple) -> None:
        self._trailing = tuple(metadata)


def ray_like_factory(service_method: str, streaming_type: gRPCStreamingType) -> Any:
    """Handlers shaped as Ray's proxy builds them; the request steers how the call ends."""

    def end(request: str, context: AioContext) -> None:
        if request == "fail":
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT.value[0])  # as Ray sets it: the number
            context.set_details(MESSAGE)
        elif request == "fail-with-trailer":
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(MESSAGE)
            context.set_trailing_metadata((("x-other", "kept"), (DETAILS_KEY, b"the replica's own")))

    if streaming_type == gRPCStreamingType.UNARY_STREAM:

        async def unary_stream(request: str, context: AioContext) -> Any:
            yield b"chunk"
            end(request, context)

        return unary_stream

    async def unary_unary(request: str, context: AioContext) -> bytes:
        end(request, context)
        return b"reply"

    return unary_unary


def _handlers(server: gRPCGenericServer) -> dict[str, Any]:
    return {
        name: handler
        for handlers in server.generic_rpc_handlers
        for h in handlers
        for name, handler in h._method_handlers.items()
    }


def _serve(scenario: Any) -> Any:
    async def main() -> Any:
        server = gRPCGenericServer(ray_like_factory)
        add_cascade_service(cascade_pb2_grpc.CascadeServiceServicer(), server)
        assert server.service_handler_factory is ray_like_factory  # restored for the services after ours
        return await scenario(_handlers(server))

    return asyncio.run(main())


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_a_failed_call_gets_the_details_trailer_of_its_code_and_message(method):
    async def scenario(handlers: dict[str, Any]) -> AioContext:
        handler = handlers[f"/cascade.v1.CascadeService/{method}"]
        context = AioContext()
        if method == "GenerateStream":
            assert [chunk async for chunk in handler.unary_stream("fail", context)] == [b"chunk"]
        else:
            assert await handler.unary_unary("fail", context) == b"reply"
        return context

    context = _serve(scenario)
    expected = rich_status(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE).SerializeToString()
    assert context.trailing_metadata() == ((DETAILS_KEY, expected),)


def test_a_successful_call_and_a_call_with_its_own_trailer_are_left_alone():
    async def scenario(handlers: dict[str, Any]) -> tuple[AioContext, ...]:
        ok, own = AioContext(), AioContext()
        await handlers["/cascade.v1.CascadeService/Generate"].unary_unary("ok", ok)
        [_ async for _ in handlers["/cascade.v1.CascadeService/GenerateStream"].unary_stream("fail-with-trailer", own)]
        return ok, own

    ok, own = _serve(scenario)
    assert ok.trailing_metadata() == ()
    assert own.trailing_metadata() == (("x-other", "kept"), (DETAILS_KEY, b"the replica's own"))


class RecordingServer:
    """A server without Ray's service_handler_factory that keeps what is registered on it."""

    def __init__(self) -> None:
        self.registered: dict[str, dict[str, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.registered[service] = handlers


def test_other_servers_get_the_plain_registration():
    # No service_handler_factory: the generated add function, nothing more: each method's handler
    # calls the servicer's own method, with no details trailer added around it.
    servicer = cascade_pb2_grpc.CascadeServiceServicer()
    server = RecordingServer()
    add_cascade_service(servicer, server)
    handlers = server.registered["cascade.v1.CascadeService"]
    assert set(handlers) == {"Generate", "GenerateStream", "CreateSession", "GetSession", "DeleteSession"}
    assert handlers["Generate"].unary_unary == servicer.Generate
    assert handlers["GenerateStream"].unary_stream == servicer.GenerateStream
    assert not hasattr(server, "service_handler_factory")  # nothing was set on it either


def test_a_call_whose_replica_died_is_unavailable_and_errors_of_the_replicas_code_keep_serves_mapping():
    # Serve's proxy maps a replica that died mid-call (RayActorError: its node lost) to INTERNAL; our
    # registration makes it UNAVAILABLE with a retry hint (tests/cluster/test_survival.py sees it for real).
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
    from ray.serve._private import proxy
    from ray.serve._private.grpc_util import get_grpc_response_status as serves_own

    _serve(lambda handlers: asyncio.sleep(0))
    _serve(lambda handlers: asyncio.sleep(0))  # registered twice (a restarted proxy): wrapped once
    status = proxy.get_grpc_response_status
    assert serves_own in [cell.cell_contents for cell in status.__closure__ or ()]  # it wraps Serve's own
    for lost in (ActorDiedError(), ActorUnavailableError("node gone", None)):
        got = status(lost, None, "request-1")
        assert got.code == grpc.StatusCode.UNAVAILABLE and "retry" in got.message, got
        assert type(lost).__name__ in got.message
    raised = RayTaskError("generate", "Traceback ...", ValueError("the replica's own error"))
    assert status(raised, None, "request-2").code == grpc.StatusCode.INTERNAL
    assert status(RuntimeError("proxy bug"), None, "request-3").code == grpc.StatusCode.INTERNAL
    assert status(TimeoutError(), 5.0, "request-4").code == grpc.StatusCode.DEADLINE_EXCEEDED
