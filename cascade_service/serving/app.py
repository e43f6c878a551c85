"""The Ray Serve application: one deployment per model tier, a coordinator/ingress, the app builder.

    tier-<name>   TierDeployment: a TierServer (model + per-request KV caches); drafts/reviews blocks
                  for many requests at once, their forward passes batched
    coordinator   CoordinatorDeployment: the ingress; runs core's cascade over RemoteTiers and
                  hosts MaG; sessions in Redis or in an in-cluster actor

Ray Serve's gRPC proxy calls the coordinator's methods by RPC name (Generate, GenerateStream, ...); its
HTTP proxy calls the coordinator's ASGI app, the OpenAI-compatible API (serving/replica_http.py).
Every replica records its metrics in Ray's metrics system too (serving/ray_metrics.py).
Each deployment takes its Ray Serve options (replicas, autoscaling, ray_actor_options with num_gpus /
accelerator_type / custom resources) from the config's `serving.deployments`, so tiers scale and
place independently; a Serve config file (deploy/serve_config.yaml) may override them again by name.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from ..api.admission import limits_from, within_limit
from ..api.backend import UNARY, RecordingContext, Reply, payload_bytes, request_type
from ..api.frontend import Frontend
from ..api.health import check_reply, watch_reply
from ..api.servicer import (
    CascadeServicer,
    caller_gone,
    fail,
)
from ..config import (
    Config,
    ModelTierConfig,
    deployment_name,
    load_config,
    local_mag,
    resolve_redis_url,
    tier_groups,
)
from ..core.local import ModelTier
from ..core.tier import Scope, Tier
from ..engine.core import EngineCore
from ..engine.heap import freeze_startup_heap
from ..engine.loop import Blocking, task_cancelled
from ..metrics import default_metrics
from ..models.hf import load_tokenizer
from ..proto.tier.v1 import tier_pb2 as pb
from ..rpc.auth import authenticate_context, load_api_keys
from ..runtime.assemble import (
    assemble_coordinator,
    hf_tokenizer,
    session_store,
)
from ..startup import check_vocabularies
from ..tierhost.modeltier import replica_tier
from ..tierhost.subcascade import check_adaptive_reviewers, system_heads
from ..transport.client import RemoteModel, connect
from ..transport.remote import RemoteTier
from ..transport.wire import facts_from_pb
from .calls import Calls, Stopped, raise_if_failed, reply_for
from .placement import deployment_options
from .policies import coordinator_policies, ray_arms
from .ray_metrics import mirror_to_ray
from .replica_http import replica_app
from .session_actor import actor_store
from .tier_deployment import (
    DEFAULT_MAX_ONGOING,
    ReplicaSpec,
    TierDeployment,
    invoker,
    replica_gpus,
)

log = logging.getLogger(__name__)

APP_NAME = "cascade"
COORDINATOR = "coordinator"
GRPC_SERVICER_FUNCTIONS = [
    "cascade_service.serving.proxy.add_cascade_service",  # with the rich error details on streams
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
    "cascade_service.rpc.reflection.add_reflection_v1",  # Ray's proxy serves v1alpha itself
]
WATCH_POLL_S = 5.0  # how often a health Watch looks for a change of status


@serve.deployment
@serve.ingress()
class CoordinatorDeployment:
    """The ingress: gRPC methods of cascade.v1.CascadeService (+ grpc.health.v1.Health/Check), and
    the OpenAI-compatible HTTP API as its ASGI app (`__serve_build_asgi_app__`)."""

    def __init__(
        self,
        config_path: str,
        tiers: dict[str, DeploymentHandle],
        redis_url: str | None = None,
        max_ongoing: int = DEFAULT_MAX_ONGOING,
    ):
        self.config: Config = load_config(config_path)
        if redis_url:  # the command line's --redis-url wins over the config's serving.redis_url
            self.config = replace(self.config, serving=replace(self.config.serving, redis_url=redis_url))
        self.handles = tiers
        # Ray Serve's gRPC proxy (a cluster's front end) runs no interceptor: its calls are checked here
        # with the same api.auth code the edge uses. Calls from our edge (rpc, rpc_stream) were checked there.
        keys_file = self.config.serving.api_keys_file
        self.api_keys = load_api_keys(keys_file) if keys_file else None
        self.local: dict[str, Any] = {}  # colocated model tiers, loaded with the servicer
        self.systems: set[str] = set()  # group members that run their sub-cascade in their replica
        self.remote: dict[str, RemoteModel] = {}  # tiers named by address (transport.client)
        self._servicer: CascadeServicer | None = None
        self._ready = threading.Lock()
        # The replica's engine core (engine.core): calls run as tasks of its loop, where colocated
        # tiers' passes batch; it loads those tiers. This pool runs what must not block Serve's event
        # loop: building the servicer, the tokenizer's load.
        self.core = EngineCore(name="coordinator")
        self.engine = self.core.loop
        self.heads = self.core.heads()  # acceptance heads of colocated tiers (adaptive draft length)
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="coordinator-setup")
        self._calls = Calls()
        # serving.admission sized to the calls Serve lets into this replica: the HTTP app's admission,
        # and the message limit calls from Ray's proxy are held to (ours refuse larger ones on receipt).
        self.limits = limits_from(self.config.serving.admission, workers=max_ongoing)
        self.http: Frontend | None = None  # the HTTP API's front end, once Serve built the app
        mirror_to_ray()

    async def __serve_build_asgi_app__(self) -> Any:
        """The HTTP app Ray Serve's proxy routes to (called once, at replica start, on the replica's loop).

        Its calls go through the same admission code as the edge's: serving.admission sized to the calls
        Serve lets into this replica, the same API keys."""
        cascade = self.config.cascade
        tokenizer = await asyncio.get_running_loop().run_in_executor(self.pool, load_tokenizer, cascade.target.path)
        app, self.http = replica_app(self, cascade.target.name, tokenizer, self.limits, self.api_keys)
        return app

    def _build(self) -> CascadeServicer:
        # Called from a worker thread: asking the tiers for their facts blocks on them.
        with self._ready:
            if self._servicer is None:
                serving, cascade = self.config.serving, self.config.cascade
                if serving.torch_threads and serving.colocate:
                    import torch

                    torch.set_num_threads(serving.torch_threads)
                colocated = [t for t in cascade.tiers if isinstance(t, ModelTierConfig) and t.name in serving.colocate]
                if colocated:  # they follow the coordinator's GPUs, as a tier replica's tiers follow its own
                    gpus = replica_gpus()
                    colocated = [replica_tier(t, gpus, COORDINATOR) for t in colocated]
                # concurrent requests share a colocated tier's passes (the core's loop batches them)
                self.local = {t.name: self.core.model(t) for t in colocated}
                facts = {name: model.facts() for name, model in self.local.items()}
                for handle in {id(h): h for h in self.handles.values()}.values():
                    hosted = pb.InfoReply.FromString(handle.info.remote().result()).tiers  # protobuf on the handle
                    facts |= {info.name: facts_from_pb(info) for info in hosted}
                # Tiers named by address: on tier servers of their own, reached over gRPC.
                self.remote = connect(cascade, serving.tier_client)
                facts |= {name: model.facts() for name, model in self.remote.items() if not model.mag}
                self.systems = set(system_heads(cascade, serving))
                coordinator = assemble_coordinator(
                    cascade,
                    facts,
                    hf_tokenizer(load_tokenizer(cascade.target.path)),
                    self._remote_tiers,
                    session_store(serving, lambda: Blocking(actor_store(serving))),
                    self.config.generation,
                    make_stopper=self.heads.stopper,  # SpecDec++ at a colocated reviewing tier
                    policies=coordinator_policies(cascade, serving),
                    loop=self.engine,
                )
                self._servicer = CascadeServicer(coordinator)
                if serving.freeze_heap:  # built at its first call: what it loaded stays for the replica's life
                    freeze_startup_heap(COORDINATOR)
            return self._servicer

    def _remote_tiers(self, scope: Scope) -> dict[str, Tier]:
        # Colocated: no hop; their passes run in the engine loop with the other requests'. Remote
        # tiers read the salt from each call; the affinity routes the calls to the replica that
        # likely holds the request's prefix (serving.routing.AffinityRouter, or the tier servers' order).
        tiers: dict[str, Tier] = {
            name: ModelTier(model.scorer(scope.cache_salt), model.vocab_size, self.heads.stopper)
            for name, model in self.local.items()
        }
        for name, handle in self.handles.items():
            call = invoker(name, handle, scope.affinity, scope.request_id)
            tiers[name] = RemoteTier(name, scope.request_id, call, system=name in self.systems)
        for name, model in self.remote.items():
            tiers[name] = model.tier(scope.request_id, scope.affinity)
        return tiers

    async def _unary(self, method: str, request: Any, grpc_context: Any) -> Any:
        within = within_limit(request, self.limits.max_message_bytes, grpc_context)  # else RESOURCE_EXHAUSTED is set
        context = authenticate_context(self.api_keys, grpc_context) if within else None
        if context is None:  # RESOURCE_EXHAUSTED or UNAUTHENTICATED is set on grpc_context
            return UNARY[method][1]()
        try:
            return await self._calls.run(self._arun(method, request, context))
        except Stopped as exc:
            fail(grpc_context, exc, None)
            return UNARY[method][1]()

    async def Generate(self, request, grpc_context):
        return await self._unary("Generate", request, grpc_context)

    async def GenerateStream(self, request, grpc_context) -> AsyncIterator[Any]:
        within = within_limit(request, self.limits.max_message_bytes, grpc_context)  # else RESOURCE_EXHAUSTED is set
        context = authenticate_context(self.api_keys, grpc_context) if within else None
        with self._calls.stream():
            if context is not None:
                try:
                    servicer = await self._calls.run(self._servicer_ready())
                    chunks = self.engine.aiterate(lambda: servicer.GenerateStream(request, context))
                    async for chunk in self._calls.iterate(chunks):
                        yield chunk
                except Stopped as exc:
                    fail(grpc_context, exc, None)
            raise_if_failed(grpc_context)

    async def CreateSession(self, request, grpc_context):
        return await self._unary("CreateSession", request, grpc_context)

    async def GetSession(self, request, grpc_context):
        return await self._unary("GetSession", request, grpc_context)

    async def DeleteSession(self, request, grpc_context):
        return await self._unary("DeleteSession", request, grpc_context)

    async def rpc(self, method: str, body: bytes, owner: str = "") -> Reply:
        """A unary call arriving as bytes from our own gRPC edge (api/edge.py), parsed once, here.

        `owner`: the caller's owner id, from the API key the edge checked (rpc/auth.py); only the edge
        holds a handle to this deployment, so it is trusted here.
        """
        code, details, response = await self.serve(method, request_type(method).FromString(body), owner)
        return code, details, payload_bytes(response)

    async def rpc_stream(self, method: str, body: bytes, owner: str = "") -> AsyncIterator[Reply]:
        """A streaming call arriving as bytes from the edge, parsed once, here."""
        replies = self.serve_stream(method, request_type(method).FromString(body), owner)
        try:
            async for code, details, payload in replies:
                yield code, details, payload_bytes(payload)
        finally:
            await replies.aclose()

    async def serve(
        self, method: str, request: Any, owner: str = "", cancelled: Callable[[], bool] | None = None
    ) -> Reply:
        """A unary call's reply, its request a message (`rpc`'s, or the replica's HTTP API's, made here);
        the response comes as a message. `cancelled`: says when the caller has gone."""
        context = RecordingContext(owner)
        try:
            response = await self._calls.run(self._arun(method, request, context, cancelled))
            return context.code.name, context.details, response
        except Stopped as exc:
            return reply_for(exc)

    async def serve_stream(
        self, method: str, request: Any, owner: str = "", cancelled: Callable[[], bool] | None = None
    ) -> AsyncGenerator[Reply, None]:
        """A streaming call's replies (chunks as messages), its request a message; a failure's status last."""
        context = RecordingContext(owner)
        with self._calls.stream():
            try:
                servicer = await self._calls.run(self._servicer_ready())
                chunks = self.engine.aiterate(functools.partial(_serve, servicer, method, request, context, cancelled))
                # Closed by iterate when the caller leaves early: the decode stops at its next round.
                async for chunk in self._calls.iterate(chunks):
                    yield "OK", "", chunk
            except Stopped as exc:
                yield reply_for(exc)
                return
            if context.code.name != "OK":
                yield context.code.name, context.details, b""

    async def _arun(self, method: str, request: Any, context: Any, cancelled: Callable[[], bool] | None = None) -> Any:
        """A unary call's response, decoded as an engine loop task (`_serve`)."""
        return await self.engine.arun(_serve, await self._servicer_ready(), method, request, context, cancelled)

    async def drain(self, grace_s: float) -> int:
        """Stop taking calls (new ones, and health, answer UNAVAILABLE / NOT_SERVING), give those in
        flight grace_s to finish, then cancel the rest, each ending UNAVAILABLE with a message, before
        Serve stops this replica. Returns how many were cancelled. `serve` calls it on SIGTERM."""
        if self.http is None:
            return await self._calls.drain(grace_s)
        # HTTP calls run through serve / serve_stream, so the calls' drain ends them; the HTTP front end
        # stops taking new ones (503) and its health says so.
        cancelled, _ = await asyncio.gather(self._calls.drain(grace_s), self.http.drain(grace_s))
        return cancelled

    def thread_settings(self) -> str:
        """torch's threads where this replica's passes run (engine.core.EngineCore.thread_settings)."""
        return self.core.thread_settings()

    def metrics_text(self) -> str:
        """This replica's metrics (the edge's `/metrics` merges them with its own and the tiers')."""
        return default_metrics().exposition().decode()

    async def _servicer_ready(self) -> CascadeServicer:
        if self._servicer is not None:
            return self._servicer
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._build)

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1: SERVING once every tier answers, NOT_SERVING while draining; NOT_FOUND for a
        service we do not serve."""
        return check_reply(request.service, await self._serving(), grpc_context)

    async def Watch(self, request, grpc_context=None) -> AsyncIterator[Any]:
        """grpc.health.v1 Watch: the status now, then each change, until the client hangs up (Serve then
        cancels this generator)."""
        last = None
        while True:
            reply = watch_reply(request.service, await self._serving())
            if reply != last:
                yield reply
                last = reply
            await asyncio.sleep(WATCH_POLL_S)

    async def _serving(self) -> bool:
        if self._calls.stopping:
            return False
        try:
            await self._servicer_ready()
            return True
        except Exception:
            log.exception("health check failed")
            return False


def _serve(
    servicer: CascadeServicer, method: str, request: Any, context: Any, cancelled: Callable[[], bool] | None = None
) -> Any:
    """Call a servicer method (an engine loop task). A caller that hangs up or runs out of time has
    Serve cancel this call: the task is told (engine.loop.task_cancelled) and its decode stops after
    the round under way; its finally blocks free the tiers' KV caches, and the session is left as it
    was. `cancelled`: the caller's own word that it has gone (the replica's HTTP API); by default the
    gRPC context's."""
    if method in ("Generate", "GenerateStream"):  # a decode: it stops between rounds once told
        gone = cancelled or caller_gone(context)
        return getattr(servicer, method)(request, context, lambda: task_cancelled() or gone())
    return getattr(servicer, method)(request, context)


def app_builder(args: dict[str, Any]):
    """`serve run cascade_service.serving.app:app_builder config=PATH`; also used by `cascade-service serve`.

    args: config (path to a cascade-service YAML config), redis_url (optional: overrides serving.redis_url;
    `${NAME}` in it is read from this process's environment, as the deploy files' `${CASCADE_REDIS_URL}`),
    local (optional bool: fractional CPUs per deployment so the app fits one small machine).
    """
    path = str(Path(args["config"]).resolve())
    config = load_config(path)
    redis_url = resolve_redis_url(args.get("redis_url") or None, "the app's redis_url argument")
    serving = config.serving
    if serving.adapt_to_load:
        ray_arms(serving.load_arms)  # a bad serving.load_arms fails here, not at the first request
    check_adaptive_reviewers(config.cascade, serving)
    # A foreign vocabulary fails here, before anything deploys (model directories this machine
    # cannot read are checked by the coordinator, once the tiers are up).
    check_vocabularies(config.cascade)
    local = bool(args.get("local", False))
    # A tier named by address is served by its own tier server (`cascade-service tier`): no deployment.
    by_name = {t.name: t for t in config.cascade.tiers if isinstance(t, ModelTierConfig) and not t.remote}
    mag = local_mag(config.cascade)
    systems = system_heads(config.cascade, serving)  # each replica learns its sub-cascades once, here
    handles: dict[str, Any] = {}
    for group in tier_groups(list(by_name), serving.colocate, serving.groups):
        name = deployment_name(group)
        options = deployment_options(serving, name, local)
        port = options.pop("grpc_port", None)  # ours: the tier API on each replica, beside the handle
        spec = ReplicaSpec(
            tiers=tuple(by_name[n] for n in group),
            mag=mag if len(group) > 1 else None,
            systems={n: sub for n, sub in systems.items() if n in group},
            torch_threads=serving.torch_threads,
            max_ongoing=options["max_ongoing_requests"],
            grpc=serving.tier_server,
            grpc_port=port,
            freeze_heap=serving.freeze_heap,
        )
        # serve.deployment makes the classes Deployments; mypy sees the classes (attr-defined below).
        handle = TierDeployment.options(name=name, **options).bind(spec)  # type: ignore[attr-defined]
        handles |= {n: handle for n in group}
    options = deployment_options(serving, COORDINATOR, local)
    return CoordinatorDeployment.options(name=COORDINATOR, **options).bind(  # type: ignore[attr-defined]
        path, handles, redis_url, options["max_ongoing_requests"]
    )
