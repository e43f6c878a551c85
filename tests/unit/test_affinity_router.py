"""serving.routing.AffinityRouter's choices, on stand-ins for Serve's replicas and requests: a key's
replica by rendezvous, a running request held to its replica when a replica joins (a scale-up moves
only new requests' keys) and moved on when its replica goes, and forgotten at its release."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from cascade_service.serving.routing import AffinityRouter, rendezvous, routing_key


def _replicas(*names: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n)) for n in names]


def _call(key: str, method: str = "review") -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(multiplexed_model_id=key, call_method=method))


def _first(router: AffinityRouter, replicas: list, key: str, method: str = "review") -> str:
    ranks = asyncio.run(router.choose_replicas(replicas, _call(key, method)))  # type: ignore[arg-type]
    return ranks[0][0].replica_id.unique_id


def _router() -> AffinityRouter:
    router = AffinityRouter.__new__(AffinityRouter)  # Serve builds it with a deployment's state; not needed here
    router.initialize_state()
    return router


def _affinity_moved_to(joined: str, before: list[str]) -> str:
    """An affinity whose rendezvous order puts `joined` first once it joins `before`."""
    for i in range(1000):
        affinity = f"affinity-{i}"
        if [*before, joined][rendezvous(affinity, [*before, joined])[0]] == joined:
            return affinity
    raise AssertionError("no such affinity")


def test_a_running_request_stays_on_its_replica_when_one_joins_and_a_new_request_moves():
    router = _router()
    affinity = _affinity_moved_to("c", ["a", "b"])
    two, three = _replicas("a", "b"), _replicas("a", "b", "c")
    started = _first(router, two, routing_key(affinity, "request-1"))
    assert started == ["a", "b"][rendezvous(affinity, ["a", "b"])[0]]
    assert _first(router, three, routing_key(affinity, "request-1")) == started  # held: no re-read
    assert _first(router, three, routing_key(affinity, "request-2")) == "c"  # a new request: the key's order
    assert _first(router, three, routing_key(affinity, "request-1"), "release") == started  # freed where it is
    assert "request-1" not in router.held
    assert _first(router, three, routing_key(affinity, "request-1")) == "c"  # a new start after a release


def test_a_request_whose_replica_went_moves_to_the_next_and_is_held_there():
    router = _router()
    key = routing_key("affinity-x", "request-1")
    started = _first(router, _replicas("a", "b", "c"), key)
    left = [n for n in ("a", "b", "c") if n != started]
    moved = _first(router, _replicas(*left), key)
    assert moved in left
    assert _first(router, _replicas("a", "b", "c"), key) == moved  # it came back: the request stays put


def test_without_a_request_id_the_key_alone_routes_as_before():
    router = _router()
    order = ["a", "b", "c"]
    assert _first(router, _replicas(*order), "affinity-y") == order[rendezvous("affinity-y", order)[0]]
    assert routing_key("affinity-y") == "affinity-y" and routing_key("", "request-1") == ""
    assert not router.held


def test_the_router_forgets_the_oldest_requests_past_its_bound():
    router = _router()
    router.initialize_state(held=3)
    for i in range(5):
        _first(router, _replicas("a", "b"), routing_key("affinity", f"request-{i}"))
    assert list(router.held) == ["request-2", "request-3", "request-4"]
