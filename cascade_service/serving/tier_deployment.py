"""The Ray Serve deployment of a tier replica (or a group of tiers), and what the app needs to place it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from ..config import ModelTierConfig, deployment_name
from ..metrics import default_metrics
from ..transport.errors import Overloaded, Unavailable
from .bridge import await_, in_bridge
from .ray_metrics import mirror_to_ray
from .tier import SubCascade, TierGroup, replica_tier

# Calls a replica works on at once (Serve's own default is 5): a tier batches concurrent requests'
# forward passes and a coordinator's requests mostly wait on tiers, so both gain from many.
# `serving.deployments.<name>.max_ongoing_requests` overrides it.
DEFAULT_MAX_ONGOING = 64


def tier_deployment_name(tier: str) -> str:
    """The deployment of a tier that is not in a group."""
    return deployment_name((tier,))


@serve.deployment
class TierDeployment:
    """A replica of one model tier, or of a group of tiers (serving.groups) with MaG beside them.

    Block calls (draft, review) carry the tier protocol's bytes (transport.codec) and block on forward
    passes, so each runs on a thread of the replica's own pool, one per call Serve lets in
    (max_ongoing); every model batches the forward passes of those concurrent calls, so requests
    decoding at once share passes.
    """

    def __init__(
        self,
        tiers: list[dict[str, Any]],
        mag: dict[str, Any] | None = None,
        torch_threads: int | None = None,
        max_ongoing: int = DEFAULT_MAX_ONGOING,
        systems: dict[str, dict[str, Any]] | None = None,
        grpc: dict[str, Any] | None = None,
    ):
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        mirror_to_ray()  # the forward passes' metrics, for the cluster's Prometheus
        mag = mag or {}
        # Each tier follows the GPUs Ray gave this replica (serving.tier.replica_tier).
        name, gpus = deployment_name([t["name"] for t in tiers]), replica_gpus()
        group = [replica_tier(ModelTierConfig(**t), gpus, name) for t in tiers]
        self.group = TierGroup(
            group,
            mag.get("bigram"),
            mag.get("max_ngram", 16),
            systems={n: SubCascade.of(spec) for n, spec in (systems or {}).items()},
        )
        for server in self.group.servers.values():
            server.model.enable_batching()
        self.pool = ThreadPoolExecutor(max_ongoing, thread_name_prefix="tier-call")
        # The tier API over gRPC as well (serving.deployments.<name>.grpc_port): coordinators outside
        # this cluster reach the same group, and their calls batch with the handle calls.
        self.grpc_server = _tier_api(self.group, grpc, max_ongoing) if grpc else None

    def grpc_port(self) -> int | None:
        return None if self.grpc_server is None else self.grpc_server.port

    def info(self) -> bytes:
        """The tier API's InfoReply, encoded: what this replica hosts (serving.tier.TierGroup.info)."""
        return self.group.info().SerializeToString()

    async def draft(self, data: bytes) -> bytes:
        return await self._blocking(self.group.draft, data)

    async def review(self, data: bytes) -> bytes:
        return await self._blocking(self.group.review, data)

    async def _blocking(self, call: Callable[[bytes], bytes], data: bytes) -> bytes:
        # A caller that cancels stops a call still queued here; one under way runs to its end (a thread
        # cannot be interrupted), which is one block: short.
        return await asyncio.get_running_loop().run_in_executor(self.pool, call, data)

    def release(self, data: bytes) -> bool:
        return self.group.release(data)

    def metrics_text(self) -> str:
        """This replica's metrics: its forward passes (the edge's `/metrics` merges them)."""
        return default_metrics().exposition().decode()

    def cached_requests(self) -> int:
        return self.group.cached_requests()

    def counters(self) -> dict[str, int]:
        return self.group.counters()


def _tier_api(group: TierGroup, grpc: dict[str, Any], workers: int):  # -> transport.server.TierServer
    from ..api.auth import TlsFiles, load_api_keys
    from ..transport.server import start_tier_server

    keys = load_api_keys(grpc["api_keys_file"]) if grpc.get("api_keys_file") else None
    cert, key, ca = grpc.get("tls_cert_file"), grpc.get("tls_key_file"), grpc.get("client_ca_file")
    tls = TlsFiles(cert, key, ca) if cert and key else None
    return start_tier_server(group, grpc["host"], grpc["port"], keys, tls, workers=workers, reuse_port=True)


def replica_gpus() -> list[int]:
    """The torch indices of the GPUs Ray gave this replica: Ray narrows CUDA_VISIBLE_DEVICES to them,
    so they are 0..n-1, unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES leaves every GPU visible."""
    ids = ray.get_gpu_ids()
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "").lower() in ("1", "true"):
        return [int(i) for i in ids]
    return list(range(len(ids)))


def invoker(name: str, handle: DeploymentHandle):
    # Serve's direct gRPC transport instead of Ray object references: measured here, a no-op call
    # takes 4.0 ms instead of 8.0 ms (median), and a round makes one or two such calls per tier.
    handle = handle.options(_by_reference=False)

    def invoke(method: str, data: bytes) -> bytes:
        if method == "release":  # fire and forget: nothing waits on a cache being freed (LRU backs it up)
            handle.release.remote(data)
            return b""
        try:
            response = getattr(handle, method).remote(data)
            # On the coordinator a decode is bridged onto the event loop, where it must await the reply.
            return await_(response) if in_bridge() else response.result()
        except BackPressureError as exc:
            raise Overloaded(f"tier {name!r} is at its queue limit; retry later") from exc
        except ray.exceptions.RayError as exc:
            raise Unavailable(f"tier {name!r} unavailable ({type(exc).__name__}); retry the request") from exc
        except Exception as exc:  # Serve's own errors (no replica, shutting down) are not RayErrors
            if type(exc).__module__.startswith("ray."):
                raise Unavailable(f"tier {name!r} unavailable ({type(exc).__name__}); retry the request") from exc
            raise

    return invoke
