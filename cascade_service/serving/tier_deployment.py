"""The Ray Serve deployment of a tier replica (or a group of tiers), and what the app needs to place it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import ray
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from ..config import MaGConfig, ModelTierConfig, TierServerConfig, deployment_name
from ..core.tier import Overloaded, Unavailable
from ..engine.core import EngineCore
from ..engine.heap import freeze_startup_heap
from ..metrics import default_metrics
from ..tierhost.group import TierGroup
from ..tierhost.modeltier import replica_tier
from ..tierhost.subcascade import SubCascade
from .ray_metrics import mirror_to_ray
from .routing import routing_key

# Calls a replica works on at once (Serve's own default is 5): a tier batches concurrent requests'
# forward passes and a coordinator's requests mostly wait on tiers, so both gain from many.
# `serving.deployments.<name>.max_ongoing_requests` overrides it.
DEFAULT_MAX_ONGOING = 64


def tier_deployment_name(tier: str) -> str:
    """The deployment of a tier that is not in a group."""
    return deployment_name((tier,))


@dataclass(frozen=True)
class ReplicaSpec:
    """What a tier deployment's replicas host and how, fixed when the app is built: its model tiers,
    MaG beside them (for a member's sub-cascade), the members that run their sub-cascade here, torch
    threads, the calls Serve lets in, and the tier API over gRPC on `grpc_port` (None: only handles)."""

    tiers: tuple[ModelTierConfig, ...]
    mag: MaGConfig | None = None
    systems: Mapping[str, SubCascade] = field(default_factory=dict)
    torch_threads: int | None = None
    max_ongoing: int = DEFAULT_MAX_ONGOING
    grpc: TierServerConfig = field(default_factory=TierServerConfig)
    grpc_port: int | None = None
    freeze_heap: bool = True  # serving.freeze_heap: once loaded, its start-up heap leaves the collector's walks


@serve.deployment
class TierDeployment:
    """A replica of one model tier, or of a group of tiers (serving.groups) with MaG beside them.

    Block calls (draft, review) carry the tier protocol's bytes (transport.codec); each runs as a task
    of the replica's engine loop (engine.loop), which batches every waiting call's forward passes of
    each model, so requests decoding at once share passes.
    """

    def __init__(self, spec: ReplicaSpec):
        if spec.torch_threads:
            import torch

            torch.set_num_threads(spec.torch_threads)
        mirror_to_ray()  # the forward passes' metrics, for the cluster's Prometheus
        # Each tier follows the GPUs Ray gave this replica (tierhost.modeltier.replica_tier).
        name, gpus = deployment_name([t.name for t in spec.tiers]), replica_gpus()
        group = [replica_tier(t, gpus, name) for t in spec.tiers]
        mag = spec.mag
        self.group = TierGroup(
            group,
            mag.bigram if mag else None,
            mag.max_ngram if mag else 16,
            systems=dict(spec.systems),
            core=EngineCore(name="tier"),  # the replica's: it loads the group's models, runs their passes
        )
        self.engine = self.group.loop
        # The tier API over gRPC as well (serving.deployments.<name>.grpc_port): coordinators outside
        # this cluster reach the same group, and their calls batch with the handle calls.
        port = spec.grpc_port
        self.grpc_server = _tier_api(self.group, spec.grpc, port, spec.max_ongoing) if port else None
        if spec.freeze_heap:
            freeze_startup_heap(name)

    def grpc_port(self) -> int | None:
        return None if self.grpc_server is None else self.grpc_server.port

    def info(self) -> bytes:
        """The tier API's InfoReply, encoded: what this replica hosts (tierhost.group.TierGroup.info)."""
        return self.group.info().SerializeToString()

    async def draft(self, data: bytes) -> bytes:
        return await self.engine.arun(self.group.draft, data)

    async def review(self, data: bytes) -> bytes:
        # A caller that cancels waits for the call under way: one block, short.
        return await self.engine.arun(self.group.review, data)

    def release(self, data: bytes) -> bool:
        return self.group.release(data)

    def metrics_text(self) -> str:
        """This replica's metrics: its forward passes (the edge's `/metrics` merges them)."""
        return default_metrics().exposition().decode()

    def cached_requests(self) -> int:
        return self.group.cached_requests()

    def counters(self) -> dict[str, int]:
        return self.group.counters()


def _tier_api(group: TierGroup, grpc: TierServerConfig, port: int, workers: int):  # -> tierhost.server.TierServer
    from ..rpc.auth import TlsFiles, load_api_keys
    from ..tierhost.server import start_tier_server

    keys = load_api_keys(grpc.api_keys_file) if grpc.api_keys_file else None
    cert, key, ca = grpc.tls_cert_file, grpc.tls_key_file, grpc.client_ca_file
    tls = TlsFiles(cert, key, ca) if cert and key else None
    return start_tier_server(group, grpc.host, port, keys, tls, workers=workers, reuse_port=True)


def replica_gpus() -> list[int]:
    """The torch indices of the GPUs Ray gave this replica: Ray narrows CUDA_VISIBLE_DEVICES to them,
    so they are 0..n-1, unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES leaves every GPU visible."""
    ids = ray.get_gpu_ids()
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "").lower() in ("1", "true"):
        return [int(i) for i in ids]
    return list(range(len(ids)))


def invoker(name: str, handle: DeploymentHandle, affinity: str = "", request_id: str = ""):
    """`transport.remote.Invoke` over a tier deployment's handle for one request; `affinity` (its
    routing key) and its id ride as the multiplexed model id, which serving.routing.AffinityRouter
    ranks replicas by, so the request's calls stay on one replica and its session's later turns meet
    their KV cache."""
    # Serve's direct gRPC transport instead of Ray object references: measured here, a no-op call
    # takes 4.0 ms instead of 8.0 ms (median), and a round makes one or two such calls per tier.
    handle = handle.options(_by_reference=False, multiplexed_model_id=routing_key(affinity, request_id))

    def invoke(method: str, data: bytes) -> bytes:
        if method == "release":  # fire and forget: nothing waits on a cache being freed (LRU backs it up)
            handle.release.remote(data)
            return b""
        try:
            # Blocks: a coordinator's engine loop runs it on its executor (transport.remote.RemoteTier).
            return getattr(handle, method).remote(data).result()
        except BackPressureError as exc:
            raise Overloaded(f"tier {name!r} is at its queue limit; retry later") from exc
        except ray.exceptions.RayError as exc:
            raise Unavailable(f"tier {name!r} unavailable ({type(exc).__name__}); retry the request") from exc
        except Exception as exc:  # Serve's own errors (no replica, shutting down) are not RayErrors
            if type(exc).__module__.startswith("ray."):
                raise Unavailable(f"tier {name!r} unavailable ({type(exc).__name__}); retry the request") from exc
            raise

    return invoke
