"""A standalone gRPC server (no Ray): the CascadeService servicer, health checking and reflection.

The embedded wiring for one process; `serving.app` is the Ray Serve wiring of the same servicer.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from ..coordinator import Coordinator
from .auth import ApiKeys, TlsFiles, bind, interceptors
from .health import set_serving
from .reflection import enable_reflection
from .servicer import CascadeServicer
from .v1 import cascade_pb2_grpc

# Calls beyond the worker threads wait in the executor's queue, which gRPC leaves unbounded; capping the
# calls in flight turns a flood into RESOURCE_EXHAUSTED (as Serve's max_queued_requests does) instead of
# memory and latency growing without limit.
MAX_QUEUED_RPCS = 64


def add_health_and_reflection(server: grpc.Server, serving: bool) -> health.HealthServicer:
    """grpc.health.v1 (overall and per service) and server reflection (v1 and v1alpha); returns the
    health servicer."""
    checker = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    set_serving(checker, serving)
    enable_reflection(server)
    return checker


def start_server(coordinator: Coordinator, host: str = "127.0.0.1", port: int = 0, workers: int = 8,
                 api_keys: ApiKeys | None = None, tls: TlsFiles | None = None,
                 max_queued: int = MAX_QUEUED_RPCS) -> tuple[grpc.Server, int]:
    """Start serving; returns the server and the bound port (port 0 picks a free one).

    api_keys: when given, every CascadeService call needs one of them (`api.auth`); tls: serve TLS.
    workers calls run at once and max_queued more wait; past that a call gets RESOURCE_EXHAUSTED.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), interceptors=interceptors(api_keys),
                         maximum_concurrent_rpcs=workers + max_queued)
    cascade_pb2_grpc.add_CascadeServiceServicer_to_server(CascadeServicer(coordinator), server)
    add_health_and_reflection(server, serving=True)
    bound = bind(server, host, port, tls)
    server.start()
    return server, bound
