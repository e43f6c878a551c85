"""Concurrent requests through the service share forward passes (issue 7): never a different token.

Each tier replica serves many block calls at once and batches their forward passes. Eight requests of
different prompt lengths and budgets decode concurrently through the Ray Serve app; each gets exactly
the target's greedy tokens (the oracle), and the target tier's counters show passes really shared.
"""

from __future__ import annotations

import threading

import pytest
import yaml

from cascade_service.client import CascadeClient
from cascade_service.serving.app import APP_NAME
from cascade_service.serving.local import LocalService
from cascade_service.serving.tier_deployment import tier_deployment_name
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle

REQUESTS = 8
PROMPTS = [p[: 4 + 2 * i] for i, p in enumerate(random_prompts(REQUESTS, 20, seed=71))]  # ragged prompts
BUDGETS = [12 + 7 * i for i in range(REQUESTS)]  # requests end at different rounds: the batch changes


@pytest.fixture(scope="module")
def service(tiny_family, tmp_path_factory):
    raw = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [{"name": "mid", "path": str(tiny_family["mid"])}, {"kind": "mag"}],
        },
        "schedule": {"k_matrix": [[3, 1], [0, 3]], "leniency": 1.5},
        # adapt_to_load: the coordinator's trial of arms (the K-matrix, lookups, plain) runs under
        # these requests; whichever arm a round gets, no token may change
        "serving": {"torch_threads": 1, "adapt_to_load": True},
    }
    path = tmp_path_factory.mktemp("batched") / "batched.yaml"
    path.write_text(yaml.safe_dump(raw))
    with LocalService(str(path), num_cpus=4) as svc:
        yield svc


def _target_counters() -> dict[str, int]:
    from ray import serve

    return serve.get_deployment_handle(tier_deployment_name("target"), app_name=APP_NAME).counters.remote().result()


def test_concurrent_requests_share_the_targets_passes_and_each_equals_the_oracle(tiny_family, service):
    expected = [oracle(tiny_family["target"], p, n) for p, n in zip(PROMPTS, BUDGETS)]
    outputs: list[object] = [None] * REQUESTS
    start = threading.Barrier(REQUESTS)

    def one(i: int) -> None:
        with CascadeClient(service.address, timeout_s=180) as client:
            start.wait()  # all at once, so their tier calls overlap
            try:
                outputs[i] = client.generate(prompt_token_ids=PROMPTS[i], max_new_tokens=BUDGETS[i]).token_ids
            except Exception as exc:
                outputs[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(REQUESTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (got, want) in enumerate(zip(outputs, expected)):
        assert got == want, f"request {i} (prompt of {len(PROMPTS[i])}, {BUDGETS[i]} new tokens): {got!r}"
    counters = _target_counters()
    print(f"target tier counters after {REQUESTS} concurrent requests: {counters}")
    assert counters["batched_passes"] > 0, counters  # the target's passes were really shared
