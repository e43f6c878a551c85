"""Ray Serve's own gRPC proxy in front of the coordinator (`serve --frontend ray`), as on a cluster.

The proxy calls the coordinator's methods by RPC name; on a local Ray it binds loopback (see
`serving/loopback.py`). Output equals `transformers` greedy `generate()`, streaming yields the same
tokens, bad input comes back as INVALID_ARGUMENT naming the field, unknown sessions as NOT_FOUND,
sessions round-trip, and nothing listens beyond loopback.
"""

from __future__ import annotations

import os

import pytest
import yaml

from cascade_service import procfs
from cascade_service.client import CascadeClient, errors
from cascade_service.models.tiny import random_prompts
from cascade_service.serving.local import LocalService

from ..integration.test_oracle import _oracle


@pytest.fixture(scope="module")
def proxied(tiny_family, tmp_path_factory):
    raw = {
        "tiers": {"target": {"name": "target", "path": str(tiny_family["target"])},
                  "drafters": [{"name": "mid", "path": str(tiny_family["mid"])}, {"kind": "mag"}]},
        "schedule": {"k_matrix": [[4, 2], [0, 6]], "leniency": 1.5},
        "serving": {"torch_threads": 1},
    }
    path = tmp_path_factory.mktemp("proxy") / "service.yaml"
    path.write_text(yaml.safe_dump(raw))
    service = LocalService(str(path), port=0, num_cpus=4, frontend="ray")
    service.start()
    yield service
    service.stop()


def test_generate_and_stream_through_rays_grpc_proxy_equal_the_oracle(tiny_family, proxied):
    with CascadeClient(proxied.address, timeout_s=120) as client:
        assert client.health() == "SERVING"
        for prompt in random_prompts(2, 9, seed=5):
            expected = _oracle(tiny_family["target"], prompt, 20)
            result = client.generate(prompt_token_ids=prompt, max_new_tokens=20)
            assert result.token_ids == expected
            assert result.stats["target_calls"] < 20
            streamed = list(client.stream(prompt_token_ids=prompt, max_new_tokens=20))
            assert [t for c in streamed for t in c.token_ids] == expected


def test_status_codes_and_sessions_through_rays_grpc_proxy(tiny_family, proxied):
    with CascadeClient(proxied.address, timeout_s=120) as client:
        with pytest.raises(errors.InvalidArgument, match="max_new_tokens"):
            client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=0)
        with pytest.raises(errors.NotFound):
            client.get_session("no-such-session")
        session = client.create_session(prompt_token_ids=[5, 6, 7])
        result = client.generate(session_id=session.session_id, prompt_token_ids=[8], max_new_tokens=6)
        assert client.get_session(session.session_id).token_ids == [5, 6, 7, 8, *result.token_ids]
        expected = _oracle(tiny_family["target"], [5, 6, 7, 8], 6)
        assert result.token_ids == expected


def test_rays_proxy_and_every_other_listener_bind_loopback(proxied):
    listeners = procfs.listeners(procfs.descendants(os.getpid()))
    assert any(port == proxied.port for _, port, _ in listeners)  # the proxy's port is seen
    exposed = procfs.beyond_loopback(listeners)
    assert not exposed, f"listening beyond loopback: {exposed}"
