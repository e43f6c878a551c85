"""grpc.health.v1 answers for the wirings that have no grpc_health servicer of their own (Ray Serve's
gRPC proxy routes Health calls to the coordinator deployment), the same as grpc_health's servicer
answers on the edge and the standalone server."""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from .servicer import SERVICE_NAME

# What health answers for: the server as a whole ("") and our service; any other name is unknown.
HEALTH_SERVICES = ("", SERVICE_NAME)


def check_reply(service: str, serving: bool, context: Any) -> Any:
    """Check: SERVING or NOT_SERVING; NOT_FOUND (set on `context`) for a service we do not serve."""
    if service not in HEALTH_SERVICES:
        context.set_code(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse()
    return status_reply(serving)


def watch_reply(service: str, serving: bool) -> Any:
    """One Watch message: an unknown service is SERVICE_UNKNOWN (the call stays open, as the protocol asks)."""
    if service not in HEALTH_SERVICES:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
    return status_reply(serving)


def status_reply(serving: bool) -> Any:
    return health_pb2.HealthCheckResponse(status=serving_status(serving))


def serving_status(serving: bool) -> Any:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
