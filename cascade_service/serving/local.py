"""The embedded wiring: local Ray, the Serve app, and our gRPC edge on loopback (`cascade-service serve`)."""

from __future__ import annotations

import functools
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray._private import auto_init_hook
from ray.serve._private.constants import RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from ..api.admission import limits_from
from ..api.backend import Call, Reply
from ..api.blocking import transport_failure
from ..api.edge import health_request, is_serving, start_edge
from ..api.frontend_server import FrontendServer
from ..config import ModelTierConfig, deployment_name, load_config, tier_groups
from ..coordinator import cache_salt
from ..core.tier import AFFINITY_TOKENS, affinity_key
from ..metrics import default_metrics, merge_expositions
from ..models.hf import load_tokenizer
from ..rpc.auth import ApiKeys, TlsFiles
from .app import APP_NAME, GRPC_SERVICER_FUNCTIONS, app_builder
from .loopback import loopback_ray
from .proxy import short_proxy_drain, wait_for_proxies
from .reap import children, descendants, end_leftovers
from .session_actor import RAY_NAMESPACE

log = logging.getLogger(__name__)


class HandleBackend:
    """The edge's `BlockingBackend`: calls the coordinator deployment through a Ray Serve handle,
    sending the request's bytes as they arrived (the replica parses them once, in its own process) and
    routing on the message the front end decoded."""

    def __init__(self, handle: DeploymentHandle):
        self.handle = handle.options(_by_reference=False)  # Serve's direct transport: half the latency
        # A request past what the direct transport carries (a replica's gRPC server takes 4 MiB by
        # default) goes through Ray's object store instead, so the coordinator answers it as it answers
        # any request (a prompt past the model's limit: INVALID_ARGUMENT naming it), not the transport.
        self.by_reference = handle.options(_by_reference=True)

    def call(self, call: Call) -> Reply:
        wire = call.wire()
        response = self._routed(call, len(wire)).rpc.remote(call.method, wire, call.owner)
        # A client that hangs up cancels the coordinator's call, which stops decoding at its next round
        # (after a normal end, cancelling a finished response does nothing).
        if not call.hooks.on_end(response.cancel):
            response.cancel()  # the client was already gone
        try:
            return response.result(timeout_s=call.timeout_s)
        except TimeoutError:
            response.cancel()
            return "DEADLINE_EXCEEDED", f"{call.method}: deadline exceeded", b""
        except RequestCancelledError:
            return "CANCELLED", f"{call.method}: cancelled by the client", b""
        except BackPressureError:
            return "RESOURCE_EXHAUSTED", "the coordinator is at its queue limit; retry later", b""
        except Exception as exc:
            return transport_failure(exc)

    def stream(self, call: Call) -> Iterator[Reply]:
        wire = call.wire()
        handle = self._routed(call, len(wire)).options(stream=True)
        return _ReplyStream(handle.rpc_stream.remote(call.method, wire, call.owner))

    def _routed(self, call: Call, size: int) -> DeploymentHandle:
        """The handle for one call of `size` bytes: a request's turns go to the coordinator replica that
        decoded the session's last ones, and requests with one prompt head meet (serving.routing); the
        rest as Serve routes them."""
        handle = self.handle if size <= DIRECT_MAX_BYTES else self.by_reference
        key = edge_affinity(call.method, call.request, call.owner)
        return handle.options(multiplexed_model_id=key) if key else handle


# The largest request the edge sends over Serve's direct transport: a replica's inter-deployment gRPC
# server receives at most RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH bytes (4 MiB unless set), and the
# call's other arguments and framing need room beside the request's bytes.
DIRECT_MAX_BYTES = RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH - (64 << 10)


def edge_affinity(method: str, request: Any, owner: str) -> str:
    """A Generate call's routing key at the edge (core.tier.affinity_key over its session, else its
    prompt's head: token ids, or the text's first characters); "" for other calls. `request`: the
    call's message, as the front end decoded it."""
    if method not in ("Generate", "GenerateStream"):
        return ""
    head = list(request.prompt_token_ids[:AFFINITY_TOKENS]) or [ord(c) for c in request.prompt[: 4 * AFFINITY_TOKENS]]
    return affinity_key(cache_salt(owner), request.session_id, head)


class _ReplyStream:
    """Iterates a streaming Serve response; close() cancels it (the coordinator stops decoding)."""

    def __init__(self, generator: Any):
        self.generator = generator
        self.closed = False

    def __iter__(self) -> _ReplyStream:
        return self

    def __next__(self) -> Reply:
        if self.closed:
            raise StopIteration
        try:
            return next(self.generator)
        except StopIteration:
            raise
        except BackPressureError:
            self.closed = True
            return "RESOURCE_EXHAUSTED", "the coordinator is at its queue limit; retry later", b""
        except Exception as exc:
            self.closed = True
            return transport_failure(exc)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.generator.cancel()


FRONTENDS = ("edge", "ray")
# The edge's calls in flight at once: each holds a thread that waits on the coordinator (which does the
# work); serving.admission.workers overrides it.
EDGE_WORKERS = 32
# Beyond the grace period, the longest a stop waits for Ray's proxy to write the statuses of the calls
# the coordinator ended (measured: well under 1 s; see stop()).
PROXY_SETTLE_S = 2.0
# After ray.shutdown(), how long the processes Ray started get to exit before they are killed (reap.py).
LEFTOVER_S = 1.0


class LocalService:
    """The embedded wiring: local Ray, the Serve app, and gRPC on loopback.

    `start()` joins a running Ray (RAY_ADDRESS or an initialized driver) or starts a local one on
    loopback (`loopback.py`), deploys the app with fractional CPUs per deployment, and serves gRPC on
    host:port (port 0 picks one). frontend "edge": our gRPC edge forwards to the coordinator through a
    handle (the default: no Serve proxy runs at all). "ray": Ray Serve's own gRPC proxy calls the
    coordinator's methods by name, as on a cluster (`deploy/serve_config.yaml`).
    """

    def __init__(
        self,
        config_path: str,
        port: int = 0,
        redis_url: str | None = None,
        host: str = "127.0.0.1",
        num_cpus: int | None = None,
        frontend: str = "edge",
        api_keys: ApiKeys | None = None,
        tls: TlsFiles | None = None,
        http_port: int | None = None,
    ):
        if frontend not in FRONTENDS:
            raise ValueError(f"frontend must be one of {FRONTENDS}, got {frontend!r}")
        if frontend == "ray" and (api_keys is not None or tls is not None):
            raise ValueError("API keys and TLS are served by the edge only: use frontend 'edge'")
        self.config_path = str(Path(config_path).resolve())
        self.port = port
        self.redis_url = redis_url
        self.host = host
        self.num_cpus = num_cpus
        self.frontend = frontend
        self.api_keys = api_keys
        self.tls = tls
        # The OpenAI-compatible HTTP API (api.openai_http): served by the edge, or by Serve's HTTP proxy
        # (frontend "ray"); None: none (the proxy then listens on a loopback port nobody is told of).
        self.http_port = http_port
        self.started_ray = False
        self.ray_processes: dict[int, str] = {}  # those ray.init started here (reap.py): pid -> start time
        self.server: FrontendServer | None = None
        self.checker: FrontendServer | None = None
        self.handle: DeploymentHandle | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> str:
        config = load_config(self.config_path)  # a bad config fails here, before Ray starts
        limits = limits_from(config.serving.admission, workers=EDGE_WORKERS)
        if not ray.is_initialized():
            if self.frontend == "ray":
                short_proxy_drain()  # so that stop() learns when the proxy holds no call
            runtime_env = loopback_ray()
            before = children()
            ray.init(
                namespace=RAY_NAMESPACE,
                include_dashboard=False,
                num_cpus=self.num_cpus,
                log_to_driver=False,
                logging_level=logging.WARNING,
                runtime_env=runtime_env,
            )
            self.ray_processes = {pid: t for pid, t in children().items() if pid not in before}
            self.started_ray = True
        # Ray starts a new local cluster when any of its APIs runs in a process without one: a thread of
        # Serve's left in this process after stop() (a handle's long poll) did so once, a second cluster
        # that nothing stops. This process uses the Ray it chose here, or none.
        auto_init_hook.enable_auto_connect = False
        if self.frontend == "ray":
            self.port = self.port or _free_port(self.host)
            # Serve's HTTP proxy comes with its gRPC proxy and serves the coordinator's HTTP app (the
            # OpenAI-compatible API): on http_port when asked for, else on a loopback port of its own.
            http_port = self.http_port or _free_port(self.host)
            serve.start(
                proxy_location="HeadOnly",
                http_options={"host": self.host, "port": http_port},
                grpc_options={"port": self.port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
            )
            self.deploy()
            self.wait_ready()
            _wait_for_proxy(self.address)
            if self.http_port is not None:
                self.http_port = http_port
                _wait_for_http(f"http://{self.host}:{http_port}/health")
            return self.address
        # No Serve proxies: our edge is the only listener.
        serve.start(proxy_location="Disabled")
        self.deploy()
        http = None
        if self.http_port is not None:
            from ..api.openai_http import http_options

            tokenizer = load_tokenizer(config.cascade.target.path)
            http = http_options(self.http_port, config.cascade.target.name, tokenizer, self.metrics_text)
        self.server, self.port, self.checker = start_edge(
            HandleBackend(self._handle()),
            self.host,
            self.port,
            api_keys=self.api_keys,
            tls=self.tls,
            limits=limits,
            http=http,
        )
        if self.http_port is not None:
            self.http_port = self.server.http_port
        self.wait_ready()
        return self.address

    def deploy(self) -> None:
        app = app_builder({"config": self.config_path, "redis_url": self.redis_url, "local": True})
        # Serve's proxies route only to an app with a route prefix; without them, none is needed.
        route = "/" if self.frontend == "ray" else None
        self.handle = serve.run(app, name=APP_NAME, route_prefix=route)

    def restart_app(self) -> None:
        """Delete and redeploy the whole app (every tier and the coordinator); the edge stays up."""
        if self.checker is not None:
            self.checker.set_serving(False)
        serve.delete(APP_NAME)
        self.deploy()
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        reply = self._handle().Check.remote(health_request()).result(timeout_s=timeout_s)
        if not is_serving(reply):
            raise RuntimeError("the cascade app started but a tier does not answer; see the Ray logs")
        if self.checker is not None:
            self.checker.set_serving(True)

    def trivial_call_latencies(self, tier: str, n: int, by_reference: bool = False) -> list[float]:
        """Seconds per no-op call to a tier's deployment from this process: the transport's floor
        (by_reference=True: Ray object references, Serve's default; False: its direct transport, ours)."""
        handle = self.tier_handle(tier).options(_by_reference=by_reference)
        seconds = []
        for _ in range(n):
            start = time.perf_counter()
            handle.cached_requests.remote().result()
            seconds.append(time.perf_counter() - start)
        return seconds

    def metrics_text(self) -> bytes:
        """The edge's metrics merged with those of the coordinator and of each tier deployment (one
        replica of each answers: all of them where each runs one, as here by default)."""
        names = dict.fromkeys(self._tier_deployments.values())
        handles = [self._handle()] + [serve.get_deployment_handle(name, APP_NAME) for name in names]
        texts = [default_metrics().exposition().decode()]
        for response in [handle.metrics_text.remote() for handle in handles]:
            try:
                texts.append(response.result(timeout_s=10))
            except Exception:  # a replica restarting: the page shows the others
                log.warning("no metrics from a deployment", exc_info=True)
        return merge_expositions(texts)

    def tier_handle(self, tier: str) -> DeploymentHandle:
        """The handle of the deployment that hosts `tier`, from this process."""
        return serve.get_deployment_handle(self._tier_deployments[tier], app_name=APP_NAME)

    @functools.cached_property
    def _tier_deployments(self) -> dict[str, str]:
        """Each model tier served by the app -> the deployment that hosts it (read from the config once,
        not at every /metrics scrape)."""
        config = load_config(self.config_path)
        models = [t.name for t in config.cascade.tiers if isinstance(t, ModelTierConfig) and not t.remote]
        groups = tier_groups(models, config.serving.colocate, config.serving.groups)
        return {tier: deployment_name(group) for group in groups for tier in group}

    def thread_settings(self) -> str:
        """torch's threads where the coordinator replica's passes run."""
        return self._handle().thread_settings.remote().result()

    def _handle(self) -> DeploymentHandle:
        # Always the current app's ingress: after a restart the old handle's deployment is gone.
        return serve.get_app_handle(APP_NAME)

    def stop(self, grace_s: float = 2.0) -> None:
        """Drain, then stop: health turns NOT_SERVING and no new call is taken; calls in flight get
        grace_s to finish, then end with UNAVAILABLE and a retry hint; Ray stops if this service
        started it (else the app is deleted, its replicas draining for their graceful_shutdown_timeout_s,
        the config's serving.shutdown_grace_s)."""
        if self.checker is not None:
            self.checker.set_serving(False)
        if self.server is not None:  # the edge: its calls in flight finish or end UNAVAILABLE
            self.server.stop(grace=grace_s).wait()
            self.server = None
        try:
            # Through Ray's proxy: the coordinator drains its own calls, and ends what is left with a
            # status before anything stops (Serve's own deadline would kill the replica mid-call).
            self._handle().drain.remote(0.0 if self.frontend == "edge" else grace_s).result(timeout_s=grace_s + 30)
            if self.frontend == "ray" and self.started_ray and not wait_for_proxies(PROXY_SETTLE_S):
                log.warning("Ray's proxy still held calls %g s after the drain; stopping anyway", PROXY_SETTLE_S)
        except Exception:
            log.debug("no coordinator or proxy to drain", exc_info=True)
        if self.started_ray:
            # Ray goes with everything in it. Every call has ended with its status (our edge ended
            # them, or Ray's proxy has written them), so deleting the app first (Serve's controller
            # stops replicas and proxies one by one, each waiting out its own graceful timeout) would
            # only hold the exit past the grace period: 60 s after a hostile run.
            started = descendants(self.ray_processes)
            ray.shutdown()
            end_leftovers(started, LEFTOVER_S)
            self.started_ray = False
            return
        try:
            serve.delete(APP_NAME)
        except Exception:
            pass

    def __enter__(self) -> LocalService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _wait_for_http(url: str, timeout_s: float = 120.0) -> None:
    """Until Serve's HTTP proxy routes to the app (it answers 404 or 503 before that)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve's HTTP proxy did not route {url} within {timeout_s:g} s")
        time.sleep(0.2)


def _wait_for_proxy(address: str, timeout_s: float = 120.0) -> None:
    """Until Serve's gRPC proxy answers a health check (it starts after the app is ready)."""
    from ..client import CascadeClient, errors

    deadline = time.monotonic() + timeout_s
    with CascadeClient(address, timeout_s=5) as client:
        while True:
            try:
                if client.health() == "SERVING":
                    return
            except errors.CascadeError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray Serve's gRPC proxy at {address} did not answer within {timeout_s:.0f} s")
            time.sleep(0.5)
