"""Cache-aware routing in the Ray app: a request's calls go to the replica that holds its KV.

Each model tier keeps requests' KV caches and a prefix cache (models.kvpool) on the replica that
served them. Ray Serve's default router picks two random replicas per call and takes the less
loaded, so a round, or a session's next turn, lands where its blocks are not and reads them again.
`AffinityRouter` ranks replicas by rendezvous hashing on the call's routing key (the request's
affinity, core.tier.affinity_key: its session's, else its prompt head's, under its API key), which
rides as the call's multiplexed model id: the first replica of that order first, the next two if it
is at its `max_ongoing_requests`. A replica that leaves moves only its own keys (to their next
replica, which re-reads them: Redis holds sessions' tokens, so the output is the same). A call with
no key goes to the less loaded of two random replicas, as with Serve's default.

The same order routes calls to tier servers over gRPC (transport.client.TierReplicas.order).
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

ROUTER_PATH = "cascade_service.serving.routing:AffinityRouter"
FALLBACKS = 2  # replicas tried after a key's own when it is at its limit


def rendezvous(key: str, names: list[str]) -> list[int]:
    """Indices of `names` in the order `key` gives them (highest weight first)."""

    def weight(i: int) -> bytes:
        return hashlib.blake2b(f"{key}\0{names[i]}".encode(), digest_size=8).digest()

    return sorted(range(len(names)), key=weight, reverse=True)


class AffinityRouter(RequestRouter):
    """Ranks replicas for a call by its routing key (see the module doc)."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        order = rendezvous(key, [r.replica_id.unique_id for r in candidate_replicas])
        ranked = [candidate_replicas[i] for i in order]
        return [ranked[:1], ranked[1 : 1 + FALLBACKS]] if len(ranked) > 1 else [ranked]
