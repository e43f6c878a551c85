"""The Ray app with tiers reached over gRPC: a drafter on a tier server of its own (by address), and
the app's own tier deployment serving the tier API on its port beside its Ray handle."""

from __future__ import annotations

import socket

import grpc
import yaml

from cascade_service.client import CascadeClient
from cascade_service.proto.tier.v1 import tier_pb2 as pb
from cascade_service.serving.local import LocalService
from cascade_service.tierhost.server import SERVICE
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle
from ..helpers.tier_servers import running, serve_group, tiny_cascade


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_ray_app_reaches_a_tier_by_address_and_serves_the_tier_api(tiny_family, tmp_path):
    mid = serve_group(tiny_cascade(tiny_family), ["mid"])
    port = _free_port()
    raw = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [{"name": "mid", "address": f"127.0.0.1:{mid.port}"}, {"kind": "mag"}],
        },
        "schedule": {"k_matrix": [[3, 1], [0, 3]], "leniency": 1.5},
        "serving": {"torch_threads": 1, "deployments": {"tier-target": {"grpc_port": port}}},
    }
    path = tmp_path / "remote.yaml"
    path.write_text(yaml.safe_dump(raw))
    prompts = random_prompts(2, 10, seed=97)
    with running(mid), LocalService(str(path), num_cpus=4) as service:
        with CascadeClient(service.address) as client:
            for prompt in prompts:
                reply = client.generate(prompt_token_ids=prompt, max_new_tokens=16)
                assert list(reply.token_ids) == oracle(tiny_family["target"], prompt, 16)
        assert mid.service.group.calls > 0  # the drafter drafted on its own server
        # The target's Ray deployment answers the tier API on its port: Info, and a review.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = pb.InfoReply.FromString(channel.unary_unary(f"/{SERVICE}/Info")(b"", timeout=30))
            assert [t.name for t in info.tiers] == ["target"]
            review = pb.ReviewRequest(
                request_id="outside",
                tier="target",
                context=pb.Context(tokens=prompts[0], stable=len(prompts[0])),
                block=pb.Block(tokens=[1], token_probs=[1.0]),
                leniency=1.0,
            )
            verdict = pb.ReviewReply.FromString(
                channel.unary_unary(f"/{SERVICE}/Review")(review.SerializeToString(), timeout=30)
            ).verdict
            expected = oracle(tiny_family["target"], prompts[0], 1)[0]  # greedy: accept 1 iff it is the argmax
            assert (verdict.accepted, verdict.token if not verdict.accepted else 1) == (int(expected == 1), expected)
