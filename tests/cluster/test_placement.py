"""A Ray cluster for real: several Ray nodes on loopback, each offering the pool resource of one kind of
GPU, and the app deployed from a Serve config of deploy/serve_config.yaml's shape (the shipped file,
with only resources changed: no GPUs here; tests/cluster/harness.py). Every tier's replicas land on the
node of its pool, as Ray reports them (not as our config says), and the cluster serves the oracle's
tokens through Serve's gRPC proxy; under load the bottleneck tier scales up and back down, alone.
"""

from __future__ import annotations

import time

import pytest

from cascade_service.client import CascadeClient
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle
from .harness import Load, N, replica_nodes, running

pytestmark = pytest.mark.cluster


def test_every_tier_lands_on_its_pool_and_the_cluster_serves_the_oracles_tokens(cluster, tiny_family):
    import ray

    grpc_port = cluster.grpc_port
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 4  # the head and three workers
    pools = {n["NodeID"]: {r for r in n["Resources"] if r.startswith("tier_")} for n in alive}
    cpus = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in alive}
    deadline = time.monotonic() + 60
    while set(replica_nodes()) != {"coordinator", "tier-large", "tier-base", "tier-small"}:
        assert time.monotonic() < deadline, replica_nodes()
        time.sleep(1)
    placed = replica_nodes()
    for tier in ("large", "base", "small"):
        assert placed[f"tier-{tier}"], tier
        assert all(f"tier_{tier}" in pools[node] for node in placed[f"tier-{tier}"]), (tier, placed, pools)
    large_node = next(iter(placed["tier-large"]))
    assert placed["tier-base"] == placed["tier-small"] != {large_node}  # the drafters' pool: another node
    coordinator_node = next(iter(placed["coordinator"]))  # the one node with CPUs for replicas
    assert cpus[coordinator_node] > 0 and not pools[coordinator_node], (placed, pools, cpus)
    prompt = random_prompts(1, 10, seed=81)[0]
    with CascadeClient(f"127.0.0.1:{grpc_port}", timeout_s=120) as client:
        result = client.generate(prompt_token_ids=prompt, max_new_tokens=N, temperature=0)
    assert result.token_ids == oracle(tiny_family["target"], prompt, N)
    assert {"large", "base", "small"} <= set(result.stats["tiers"])


def test_the_bottleneck_tier_scales_up_under_load_and_back_down_alone(cluster, tiny_family):
    grpc_port = cluster.grpc_port
    prompts = random_prompts(8, 10, seed=83)
    expected = [oracle(tiny_family["target"], p, N) for p in prompts]
    timeline: list[tuple[float, dict[str, int]]] = []
    assert running()["tier-large"] == 1
    began = time.monotonic()
    up = None
    with Load(grpc_port, prompts, expected) as load:
        while time.monotonic() - began < 150:
            timeline.append((time.monotonic() - began, running()))
            if up is None and timeline[-1][1]["tier-large"] >= 2:
                up = timeline[-1][0]
            if up is not None and timeline[-1][0] > up + 5:
                break
            time.sleep(1)
    ended = time.monotonic() - began
    down = None
    while time.monotonic() - began < ended + 150:
        timeline.append((time.monotonic() - began, running()))
        if timeline[-1][1]["tier-large"] == 1:
            down = timeline[-1][0] - ended
            break
        time.sleep(1)
    compact = [(round(t), c["tier-large"], c["starting"]) for t, c in timeline]
    print(
        f"autoscaling: tier-large at 2+ replicas {up} s into the ramp, back to 1 {down} s after it; "
        f"{load.ok()} calls served; {compact}"
    )
    assert not load.failures() and not load.wrong, (load.failures(), load.wrong)
    assert load.ok() >= len(prompts)  # the load ran: every stream was served
    # The goal is 60 s; on 2 busy cores a replica takes 12-35 s to start (docs/benchmarks.md),
    # so the test holds it to 150.
    assert up is not None and up <= 150, timeline
    assert down is not None and down <= 120, timeline
    for name in ("coordinator", "tier-base", "tier-small"):  # the others stayed at their minimum
        assert {counts[name] for _, counts in timeline} == {1}, (name, timeline)
    # No request read its context twice: the prompts are shorter than a KV block, so nothing is cached and
    # each call of one prompt feeds the target the same tokens, unless the call moved to the new replica
    # mid-request (serving.routing holds a request to its replica; rendezvous alone would move half the keys).
    fed: dict[int, set[int]] = {}
    for i, _, _, stats in load.stats:
        fed.setdefault(i, set()).add(stats["tiers"]["large"]["tokens_processed"])
    assert all(len(counts) == 1 for counts in fed.values()), fed
