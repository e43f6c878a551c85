"""A tier server that dies mid-request: the request completes exactly on another replica, or fails
UNAVAILABLE when none is left; never wrong tokens. And the channel's security: TLS, client
certificates, keys, and the refusal of a plaintext tier off loopback."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from cascade_service.config import ConfigError, GenerationConfig, parse_config
from cascade_service.config.serving import TierClientConfig
from cascade_service.core.tier import Unavailable
from cascade_service.inprocess import InProcess
from cascade_service.zoo.tiny import random_prompts

from ..helpers.access import KEY_A, self_signed_cert, write_keys
from ..helpers.oracle import oracle
from ..helpers.tier_servers import addressed, running, serve_group, tiny_cascade

PROMPT = random_prompts(1, 10, seed=47)[0]
N = 40


def _kill_when_called(servers, stopped: list) -> threading.Thread:
    """Stop whichever replica serves a call first (it holds the request), once it has served a few."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for server in servers:
                if server.service.group.calls >= 3:
                    stopped.append(server)
                    server.stop()
                    return
            time.sleep(0.001)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_replica_that_dies_mid_request_is_failed_over_and_the_tokens_stay_exact(tiny_family):
    cascade = tiny_cascade(tiny_family, mag=False)
    replicas = [serve_group(cascade, ["target"]) for _ in range(2)]
    with running(*replicas):
        engine = InProcess(addressed(cascade, {"target": replicas}))
        stopped: list = []
        watcher = _kill_when_called(replicas, stopped)
        result = engine.generate(PROMPT, GenerationConfig(max_new_tokens=N))
        watcher.join()
        assert stopped, "no replica was stopped mid-request"
        assert result.token_ids == oracle(tiny_family["target"], PROMPT, N)
        survivor = next(r for r in replicas if r is not stopped[0])
        assert survivor.service.group.calls > 0  # the rest of the request ran there
        assert engine.target.replicas.failovers >= 1


def test_with_no_replica_left_the_call_fails_unavailable(tiny_family):
    cascade = tiny_cascade(tiny_family, mag=False)
    server = serve_group(cascade, ["target"])
    engine = InProcess(addressed(cascade, {"target": server}))
    stopped: list = []
    watcher = _kill_when_called([server], stopped)
    with pytest.raises(Unavailable, match="no replica answered"):
        engine.generate(PROMPT, GenerationConfig(max_new_tokens=N))
    watcher.join()


def test_the_edge_answers_unavailable_when_a_tier_is_down(tiny_family):
    from cascade_service.config import Config
    from cascade_service.proto.v1 import cascade_pb2 as pb
    from cascade_service.proto.v1 import cascade_pb2_grpc as pb_grpc
    from cascade_service.standalone import start_standalone

    cascade = tiny_cascade(tiny_family, mag=False)
    server = serve_group(cascade, ["close"])
    standalone = start_standalone(Config(addressed(cascade, {"close": server})))
    channel = grpc.insecure_channel(f"127.0.0.1:{standalone.port}")
    try:
        stub = pb_grpc.CascadeServiceStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=8)
        assert list(stub.Generate(request, timeout=60).token_ids) == oracle(tiny_family["target"], PROMPT, 8)
        server.stop()
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"tier server 127.0.0.1:{server.port} unavailable" in info.value.details()
    finally:
        channel.close()
        standalone.stop()


def test_tls_with_client_certificates_and_a_key(tiny_family, tmp_path):
    from cascade_service.rpc.auth import TlsFiles, load_api_keys

    (tmp_path / "server").mkdir()
    (tmp_path / "client").mkdir()
    cert, key, _ = self_signed_cert(tmp_path / "server")
    client_cert, client_key, _ = self_signed_cert(tmp_path / "client")  # self-signed: its own CA
    cascade = tiny_cascade(tiny_family, mag=False)
    server = serve_group(
        cascade,
        ["close"],
        tls=TlsFiles(cert, key, client_ca_file=client_cert),
        api_keys=load_api_keys(write_keys(tmp_path / "keys")),
    )
    with running(server):
        remote = addressed(cascade, {"close": server})
        full = TierClientConfig(True, cert, client_cert, client_key, KEY_A, 10.0)
        engine = InProcess(remote, tier_client=full)
        result = engine.generate(PROMPT, GenerationConfig(max_new_tokens=12))
        assert result.token_ids == oracle(tiny_family["target"], PROMPT, 12)
        for wrong in (
            TierClientConfig(True, cert, None, None, KEY_A, 5.0),  # no client certificate
            TierClientConfig(False, None, None, None, KEY_A, 5.0),  # plaintext to a TLS server
        ):
            with pytest.raises(ConfigError, match="unavailable"):
                InProcess(remote, tier_client=wrong)
        with pytest.raises(ConfigError, match="UNAUTHENTICATED"):  # the right channel, no key
            InProcess(remote, tier_client=TierClientConfig(True, cert, client_cert, client_key, None, 5.0))


def test_a_plaintext_tier_off_loopback_is_refused_by_the_config(tmp_path):
    raw = {
        "tiers": {
            "target": {"path": str(tmp_path)},
            "drafters": [{"name": "small", "address": "10.1.2.3:7000"}],
        },
        "schedule": {"k_matrix": [[4]]},
    }
    with pytest.raises(ConfigError, match="10.1.2.3:7000 is not a loopback address"):
        parse_config(raw)
    raw["serving"] = {"tier_client": {"tls": True, "api_key": "k"}}
    config = parse_config(raw)
    assert config.cascade.drafters[0].address == ("10.1.2.3:7000",) and config.serving.tier_client.tls


@pytest.mark.parametrize(
    "address, match",
    [
        ("nope", "is not host:port"),
        ("h:0", "a port in 1..65535"),
        (["h:1", "h:1"], "distinct"),
        ([], "host:port or a list"),
    ],
)
def test_bad_addresses_are_refused_naming_the_field(tmp_path, address, match):
    raw = {
        "tiers": {"target": {"path": str(tmp_path)}, "drafters": [{"name": "small", "address": address}]},
        "schedule": {"k_matrix": [[4]]},
    }
    with pytest.raises(ConfigError, match=r"tiers\.drafters\[0\]\.address") as info:
        parse_config(raw)
    assert match in str(info.value)
