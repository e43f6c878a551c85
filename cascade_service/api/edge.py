"""The gRPC edge in front of a remote coordinator: bound to the address we choose, forwarding bytes.

`cascade-service serve` runs this in its own process on loopback and forwards each call, as the
protobuf bytes it arrived as (decoded once here, for admission and routing), to the coordinator
deployment through a `BlockingBackend` (a Ray Serve handle; see `serving.local.HandleBackend`), each
call on a worker thread (`api.blocking.OnThreads`). Ray Serve's own gRPC proxy listens on every
interface with no way to choose, so it is used on clusters (deploy/serve_config.yaml) and not for the
local default. The edge also serves standard health checking and reflection, and turns a client's
cancel into a cancel of the remote call.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health_pb2

from ..rpc.auth import ApiKeys, TlsFiles
from .admission import Limits
from .blocking import BlockingBackend, OnThreads
from .frontend_server import FrontendServer, HttpOptions, start_frontend
from .server import MAX_QUEUED_RPCS


def start_edge(
    backend: BlockingBackend,
    host: str = "127.0.0.1",
    port: int = 0,
    workers: int = 32,
    api_keys: ApiKeys | None = None,
    tls: TlsFiles | None = None,
    max_queued: int = MAX_QUEUED_RPCS,
    limits: Limits | None = None,
    http: HttpOptions | None = None,
) -> tuple[FrontendServer, int, FrontendServer]:
    """Serve CascadeService + health + reflection on host:port, forwarding each admitted call's bytes
    to `backend`; returns (server, port, the server again as the health switch: its `set_serving`).

    Health answers NOT_SERVING until the wiring sees the app answer. api_keys, tls, workers, max_queued
    and limits as `api.server.start_server` takes them; http: the OpenAI-compatible HTTP API too.
    """
    limits = limits or Limits(workers=workers, max_queued=max_queued)
    server = start_frontend(OnThreads(backend, limits.workers), host, port, limits, api_keys, tls, False, http)
    return server, server.port, server


def health_request() -> Any:
    return health_pb2.HealthCheckRequest()


def is_serving(reply: Any) -> bool:
    return reply.status == health_pb2.HealthCheckResponse.SERVING
