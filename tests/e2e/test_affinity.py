"""Cache-aware routing in a real Ray Serve app: a session's turns meet their KV on a tier scaled out.

The target's deployment runs two replicas. Every call carries its request's routing key (its
session's), and `serving.routing.AffinityRouter` sends it to the key's replica, so each later turn
finds the history in that replica's prefix cache (Serve's default router would pick one of the two at
random per call: a miss about every other turn). Output is the oracle's throughout.
"""

from __future__ import annotations

import pytest
import yaml

from cascade_service.client import CascadeClient
from cascade_service.models.kvpool import BLOCK
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle

N = 8


@pytest.fixture(scope="module")
def service(tiny_family, tmp_path_factory):
    from cascade_service.serving.local import LocalService

    raw = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [{"name": "mid", "path": str(tiny_family["mid"])}],
        },
        "schedule": {"k_matrix": [[4]], "leniency": 1.0},
        "generation": {"max_new_tokens": N},
        "serving": {
            "torch_threads": 1,
            "adapt_to_load": False,
            "deployments": {"tier-target": {"num_replicas": 2}},
        },
    }
    path = tmp_path_factory.mktemp("affinity") / "service.yaml"
    path.write_text(yaml.safe_dump(raw))
    svc = LocalService(str(path), port=0, num_cpus=4)
    svc.start()
    yield svc
    svc.stop()


def test_a_sessions_turns_find_their_history_cached_on_a_scaled_out_tier(tiny_family, service):
    with CascadeClient(service.address, timeout_s=120) as client:
        session = client.create_session()
        history: list[int] = []
        cached = []
        for turn in random_prompts(5, 40, seed=71):
            result = client.generate(session_id=session.session_id, prompt_token_ids=turn, temperature=0)
            assert result.token_ids == oracle(tiny_family["target"], history + turn, N)
            cached.append((result.stats["tiers"]["target"].get("tokens_cached", 0), len(history)))
            history += turn + result.token_ids
    assert cached[0][0] == 0
    # Every later turn on the replica that holds the history: all of it cached but its last token (the
    # last round's bonus, never fed) and the block that token was in; one block less when the previous
    # turn's release (fire and forget) had not arrived yet.
    for got, before in cached[1:]:
        whole = (before - 1) // BLOCK * BLOCK
        assert whole - BLOCK <= got <= whole and got > 0, cached
