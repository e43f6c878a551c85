"""The served front ends of the conformance suites (test_api_controls, test_conformance): one real
`cascade-service serve` process per front end and module (test_conformance's last test stops each with
SIGTERM, within grace + 5 s on every front end)."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass

import grpc
import pytest

from cascade_service.proto.v1 import cascade_pb2_grpc

from .serve_process import ServeProcess, write_config

FRONTENDS = ("standalone", "edge", "ray")
GRACE_S = 3.0
# Beyond the grace period: every front end's stop (Serve and Ray included) is bounded at grace + 5 s.
TEARDOWN_BOUND_S = 5.0


@dataclass
class Served:
    frontend: str
    address: str
    process: subprocess.Popen
    channel: grpc.Channel
    http_url: str

    @property
    def stub(self) -> cascade_pb2_grpc.CascadeServiceStub:
        return cascade_pb2_grpc.CascadeServiceStub(self.channel)


@pytest.fixture(scope="module", params=FRONTENDS)
def served(request, tiny_family, tmp_path_factory):
    config = write_config(
        tmp_path_factory.mktemp(f"conformance-{request.param}") / "service.yaml", tiny_family, GRACE_S
    )
    server = ServeProcess(config, request.param, http=True)
    channel = grpc.insecure_channel(server.address)
    assert server.http_url is not None
    yield Served(request.param, server.address, server.process, channel, server.http_url)
    channel.close()
    if server.process.poll() is None:  # the SIGTERM test did not run (e.g. -k): stop it anyway
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=GRACE_S + TEARDOWN_BOUND_S)
        except subprocess.TimeoutExpired:
            server.process.kill()
            raise
