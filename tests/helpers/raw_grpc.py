"""A hostile client's tools: raw grpc.aio calls that send what they like (or nothing), over loopback."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from .grpc_errors import field_violations, status_details

GENERATE = "/cascade.v1.CascadeService/Generate"
CASCADE_METHODS = [
    f"/cascade.v1.CascadeService/{m}"
    for m in ("Generate", "GenerateStream", "CreateSession", "GetSession", "DeleteSession")
]
STREAMING = {"/cascade.v1.CascadeService/GenerateStream", "/grpc.health.v1.Health/Watch"}
REFLECTION = [
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
]
HEALTH = ["/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"]


def own_channel(address: str) -> grpc.aio.Channel:
    # A connection of its own (grpc shares one per target across channels by default).
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def idle_call(channel: grpc.aio.Channel, path: str, metadata: Any = None) -> Any:
    """A call that sends its headers and never a message (nor its half-close)."""
    return channel.stream_stream(path)(metadata=metadata)


async def health_check(channel: grpc.aio.Channel, timeout: float = 5) -> int:
    call = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    return (await call(health_pb2.HealthCheckRequest(), timeout=timeout)).status


async def raw_call(channel: grpc.aio.Channel, path: str, body: bytes, timeout: float = 30) -> grpc.aio.AioRpcError:
    """Send `body` as the one message of `path`; the error the call ends with."""
    if path in STREAMING or path in REFLECTION:
        call = channel.stream_stream(path)(iter([body]), timeout=timeout)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
        return caught.value
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(path)(body, timeout=timeout)
    return caught.value


def violated_fields(error: grpc.aio.AioRpcError) -> list[str]:
    """The fields of the FieldViolations in the error's details trailer (which repeats its code and message)."""
    status = status_details(error)
    assert (status.code, status.message) == (error.code().value[0], error.details())
    return field_violations(status)
