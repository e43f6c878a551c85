"""The embedded wiring: local Ray, the Serve app, and our gRPC edge on loopback (`cascade-service serve`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from ..api.edge import Reply, health_request, is_serving, set_serving, start_edge
from ..config import ModelTierConfig, deployment_name, load_config, tier_groups
from .app import APP_NAME, app_builder
from .session_actor import RAY_NAMESPACE


class HandleBackend:
    """The edge's `Backend`: calls the coordinator deployment through a Ray Serve handle."""

    def __init__(self, handle: DeploymentHandle):
        self.handle = handle.options(_by_reference=False)  # Serve's direct transport: half the latency

    def call(self, method: str, body: bytes, timeout_s: float | None) -> Reply:
        response = self.handle.rpc.remote(method, body)
        try:
            return response.result(timeout_s=timeout_s)
        except TimeoutError:
            response.cancel()
            return "DEADLINE_EXCEEDED", f"{method}: deadline exceeded", b""
        except Exception as exc:  # noqa: BLE001 - Ray / Serve errors: the coordinator is not reachable
            return "UNAVAILABLE", f"coordinator unavailable ({type(exc).__name__}); retry", b""

    def stream(self, method: str, body: bytes, timeout_s: float | None) -> Iterator[Reply]:
        return _ReplyStream(self.handle.options(stream=True).rpc_stream.remote(method, body))


class _ReplyStream:
    """Iterates a streaming Serve response; close() cancels it (the coordinator stops decoding)."""

    def __init__(self, generator: Any):
        self.generator = generator
        self.closed = False

    def __iter__(self) -> "_ReplyStream":
        return self

    def __next__(self) -> Reply:
        if self.closed:
            raise StopIteration
        try:
            return next(self.generator)
        except StopIteration:
            raise
        except Exception as exc:  # noqa: BLE001
            self.closed = True
            return "UNAVAILABLE", f"coordinator unavailable ({type(exc).__name__}); retry", b""

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.generator.cancel()


class LocalService:
    """The embedded wiring: local Ray, the Serve app, and our gRPC edge on loopback.

    `start()` joins a running Ray (RAY_ADDRESS or an initialized driver) or starts a local one, deploys
    the app with fractional CPUs per deployment, and serves gRPC on host:port (port 0 picks one).
    """

    def __init__(self, config_path: str, port: int = 0, redis_url: str | None = None, host: str = "127.0.0.1",
                 num_cpus: int | None = None):
        self.config_path = str(Path(config_path).resolve())
        self.port = port
        self.redis_url = redis_url
        self.host = host
        self.num_cpus = num_cpus
        self.started_ray = False
        self.server = None
        self.checker = None
        self.handle: DeploymentHandle | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> str:
        load_config(self.config_path)  # a bad config fails here, before Ray starts
        if not ray.is_initialized():
            ray.init(namespace=RAY_NAMESPACE, include_dashboard=False, num_cpus=self.num_cpus,
                     log_to_driver=False, logging_level=logging.WARNING)
            self.started_ray = True
        # No Serve proxies: our edge is the only listener (Ray's gRPC proxy would bind every interface).
        serve.start(proxy_location="Disabled")
        self.deploy()
        self.server, self.port, self.checker = start_edge(HandleBackend(self._handle()), self.host, self.port)
        self.wait_ready()
        return self.address

    def deploy(self) -> None:
        app = app_builder({"config": self.config_path, "redis_url": self.redis_url, "local": True})
        self.handle = serve.run(app, name=APP_NAME, route_prefix=None)

    def restart_app(self) -> None:
        """Delete and redeploy the whole app (every tier and the coordinator); the edge stays up."""
        if self.checker is not None:
            set_serving(self.checker, False)
        serve.delete(APP_NAME)
        self.deploy()
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        reply = self._handle().Check.remote(health_request()).result(timeout_s=timeout_s)
        if not is_serving(reply):
            raise RuntimeError("the cascade app started but a tier does not answer; see the Ray logs")
        if self.checker is not None:
            set_serving(self.checker, True)

    def trivial_call_latencies(self, tier: str, n: int, by_reference: bool = False) -> list[float]:
        """Seconds per no-op call to a tier's deployment from this process: the transport's floor
        (by_reference=True: Ray object references, Serve's default; False: its direct transport, ours)."""
        config = load_config(self.config_path)
        models = [t.name for t in config.cascade.tiers if isinstance(t, ModelTierConfig)]
        name = next(deployment_name(g) for g in tier_groups(models, config.serving.colocate, config.serving.groups)
                    if tier in g)
        handle = serve.get_deployment_handle(name, app_name=APP_NAME).options(_by_reference=by_reference)
        seconds = []
        for _ in range(n):
            start = time.perf_counter()
            handle.cached_requests.remote().result()
            seconds.append(time.perf_counter() - start)
        return seconds

    def _handle(self) -> DeploymentHandle:
        # Always the current app's ingress: after a restart the old handle's deployment is gone.
        return serve.get_app_handle(APP_NAME)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=2).wait()
            self.server = None
        try:
            serve.delete(APP_NAME)
        except Exception:  # noqa: BLE001 - stopping is best effort
            pass
        if self.started_ray:
            serve.shutdown()
            ray.shutdown()
            self.started_ray = False

    def __enter__(self) -> "LocalService":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
