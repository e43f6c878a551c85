"""Lost nodes (last in tests/cluster: they replace nodes). The drafters' node, then the coordinator's, is
killed under load: requests in flight finish exactly or fail with UNAVAILABLE and a retry hint, a session
in Redis outlives it, and once a node of that pool joins again (as a cluster autoscaler adds one) Serve
places the replicas there and the service is back, within a minute."""

from __future__ import annotations

import time

import pytest

from cascade_service.client import CascadeClient
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle
from .harness import Load, N, replica_nodes

pytestmark = pytest.mark.cluster

# node killed -> the deployments that lived on it
LOST = {"drafters": ("tier-base", "tier-small"), "cpu": ("coordinator",)}


@pytest.mark.parametrize("node", ["drafters", "cpu"], ids=["drafters-node", "coordinator-node"])
def test_a_lost_node_fails_only_calls_in_flight_and_the_service_comes_back(cluster, node):
    import ray

    target = cluster.family["target"]
    prompts = random_prompts(4, 10, seed=82)
    expected = [oracle(target, p, N) for p in prompts]
    with CascadeClient(f"127.0.0.1:{cluster.grpc_port}", timeout_s=120) as client:
        session = client.create_session(prompt_token_ids=prompts[0])
        first = client.generate(session_id=session.session_id, prompt_token_ids=[], max_new_tokens=N, temperature=0)
    with Load(cluster.grpc_port, prompts, expected, pause_s=0.2) as load:
        deadline = time.monotonic() + 60
        while load.ok() < 8:
            assert time.monotonic() < deadline, load.messages
            time.sleep(0.1)
        lost = cluster.replace(node)
        deadline = lost + 120
        while not any(at > lost + 1 and o == "ok" for at, o in load.outcomes[-4:]):
            assert time.monotonic() < deadline, load.messages[-10:]
            time.sleep(0.2)
    back = min(at for at, o in load.outcomes if at > lost + 1 and o == "ok")
    failures = load.failures()
    assert not load.wrong and set(failures) <= {"UNAVAILABLE"}, (load.wrong, load.messages)
    assert back - lost < 60, back - lost
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    placed = replica_nodes()
    assert all(placed[name] and placed[name] <= alive for name in LOST[node]), placed
    with CascadeClient(f"127.0.0.1:{cluster.grpc_port}", timeout_s=120) as client:  # the session is whole
        more = client.generate(session_id=session.session_id, prompt_token_ids=[5], max_new_tokens=N, temperature=0)
        assert more.token_ids == oracle(target, prompts[0] + first.token_ids + [5], N)
    print(f"lost the {node} node: {len(failures)} calls failed (UNAVAILABLE), served again after {back - lost:.1f} s")
