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

A request stays where it started: the key carries the request's id after the affinity (`routing_key`),
and the router holds the replica a request's first call was ranked to until its release. A replica
that joins (a scale-up) takes its share of new requests' keys, never a running request, which would
read its whole context there again.

The same order routes calls to tier servers over gRPC (transport.client.TierReplicas.order).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

ROUTER_PATH = "cascade_service.serving.routing:AffinityRouter"
FALLBACKS = 2  # replicas tried after a key's own when it is at its limit
SEPARATOR = "\x1f"  # between a routing key's affinity and its request id
HELD = 65536  # requests whose replica a router remembers (the oldest forgotten first)


def routing_key(affinity: str, request_id: str = "") -> str:
    """The multiplexed model id of a request's tier calls: its affinity, then its id (held to a replica)."""
    return f"{affinity}{SEPARATOR}{request_id}" if affinity and request_id else affinity


def rendezvous(key: str, names: list[str]) -> list[int]:
    """Indices of `names` in the order `key` gives them (highest weight first)."""

    def weight(i: int) -> bytes:
        return hashlib.blake2b(f"{key}\0{names[i]}".encode(), digest_size=8).digest()

    return sorted(range(len(names)), key=weight, reverse=True)


class AffinityRouter(RequestRouter):
    """Ranks replicas for a call by its routing key (see the module doc)."""

    def initialize_state(self, held: int = HELD, **kwargs) -> None:
        """Serve calls it with the deployment's request_router_kwargs: `held` bounds the requests kept."""
        self.held: OrderedDict[str, str] = OrderedDict()  # request id -> the unique id of its replica
        self.held_limit = held

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        affinity, _, request = key.partition(SEPARATOR)
        order = rendezvous(affinity, [r.replica_id.unique_id for r in candidate_replicas])
        ranked = [candidate_replicas[i] for i in order]
        if request and pending_request is not None:
            ranked = self._hold(request, ranked, pending_request.metadata.call_method == "release")
        return [ranked[:1], ranked[1 : 1 + FALLBACKS]] if len(ranked) > 1 else [ranked]

    def _hold(self, request: str, ranked: list[RunningReplica], releasing: bool) -> list[RunningReplica]:
        """`ranked` with the request's replica first while it is a candidate; held from the request's
        first call (its ranked first) until its release. If that replica went, the request moves to
        its next in the key's order, and is held there."""
        held = self.held.pop(request, None) if releasing else self.held.get(request)
        mine = [r for r in ranked if r.replica_id.unique_id == held]
        if mine:
            ranked = mine + [r for r in ranked if r is not mine[0]]
        if not releasing:
            self.held[request] = ranked[0].replica_id.unique_id
            self.held.move_to_end(request)
            while len(self.held) > self.held_limit:
                self.held.popitem(last=False)
        return ranked
