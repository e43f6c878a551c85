"""The HTTP API under load and faults: 429 when the queue is full, 503 when a tier is down, and a
client that disconnects cancels its request (the decode stops, the tiers release its KV caches)."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from cascade_service.config import Config, GenerationConfig
from cascade_service.standalone import start_standalone
from cascade_service.zoo.tiny import random_prompts

from ..helpers.threads import soon
from ..helpers.tier_servers import addressed, serve_group, tiny_cascade

PROMPT = random_prompts(1, 10, seed=59)[0]


class Gate:
    """A tier server's group whose block calls wait until the gate opens (a slow or stuck tier)."""

    def __init__(self, group):
        self.group, self.open, self.calls = group, threading.Event(), 0
        self.mag_vocab, self.loop = group.mag_vocab, group.loop

    def draft(self, data: bytes) -> bytes:
        self.calls += 1
        self.open.wait(60)
        return self.group.draft(data)

    def review(self, data: bytes) -> bytes:
        self.calls += 1
        self.open.wait(60)
        return self.group.review(data)

    def release(self, data: bytes) -> bool:
        return self.group.release(data)

    def info(self):
        return self.group.info()

    def close(self) -> None:
        self.open.set()
        self.group.close()


@pytest.fixture
def gated(tiny_family):
    """A standalone server (1 worker, no queue) whose target is on a gated tier server."""
    from cascade_service.cli.tier import tier_group
    from cascade_service.tierhost.server import start_tier_server

    cascade = tiny_cascade(tiny_family, mag=False)
    gate = Gate(tier_group(Config(cascade), ["target"]))
    server = start_tier_server(gate)
    from cascade_service.config import ServingConfig

    config = Config(
        addressed(cascade, {"target": server}),
        GenerationConfig(max_new_tokens=32),
        ServingConfig(admission={"workers": 1, "max_queued": 0}),
    )
    standalone = start_standalone(config, http_port=0, max_streams=1)
    yield standalone, gate, server
    gate.open.set()
    standalone.stop()
    server.stop()


def _post(port: int, body: dict, timeout: float = 60) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    return reply.status, json.loads(reply.read())


def test_a_full_queue_is_429_and_the_held_request_completes(gated):
    standalone, gate, _ = gated
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 8}
    first: list = []
    holder = threading.Thread(target=lambda: first.append(_post(standalone.http_port, body)))
    holder.start()
    assert soon(lambda: gate.calls > 0)  # the one worker is busy
    status, reply = _post(standalone.http_port, body)
    assert status == 429 and reply["error"]["type"] == "rate_limit_error", reply
    gate.open.set()
    holder.join(60)
    assert first and first[0][0] == 200 and first[0][1]["usage"]["completion_tokens"] == 8


def test_a_client_that_disconnects_cancels_its_request(gated):
    standalone, gate, _ = gated
    connection = http.client.HTTPConnection("127.0.0.1", standalone.http_port, timeout=60)
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 32, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    assert soon(lambda: gate.calls > 0)
    connection.sock.close()  # the client goes away while its first round waits on the tier
    connection.close()
    time.sleep(0.5)
    gate.open.set()
    # The decode stops at its next round: far fewer than 32 target rounds, and the tier holds nothing.
    assert soon(lambda: gate.group.cached_requests() == 0)
    time.sleep(0.5)
    assert gate.calls <= 4, gate.calls


def test_a_tier_that_is_down_is_503(tiny_family):
    cascade = tiny_cascade(tiny_family, mag=False)
    close = serve_group(cascade, ["close"])
    standalone = start_standalone(Config(addressed(cascade, {"close": close})), http_port=0)
    try:
        assert _post(standalone.http_port, {"model": "target", "prompt": PROMPT, "max_tokens": 4})[0] == 200
        close.stop()
        status, reply = _post(standalone.http_port, {"model": "target", "prompt": PROMPT, "max_tokens": 4})
        assert status == 503 and reply["error"]["type"] == "service_unavailable_error", reply
        assert "unavailable" in reply["error"]["message"]
    finally:
        standalone.stop()
