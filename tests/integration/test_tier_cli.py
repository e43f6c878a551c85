"""`cascade-service tier` as a user runs it: a process that serves the tier API, stops on SIGTERM, and
refuses what it must refuse before loading anything."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
import pytest
import yaml

from cascade_service.cli.main import main
from cascade_service.proto.tier.v1 import tier_pb2 as pb
from cascade_service.tierhost.server import SERVICE


@pytest.fixture
def config_path(tiny_family, tmp_path):
    raw = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [{"name": "mid", "path": str(tiny_family["mid"])}, {"kind": "mag"}],
        },
        "schedule": {"k_matrix": [[3, 1], [0, 3]]},
    }
    path = tmp_path / "tiers.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_tier_process_serves_and_stops_on_sigterm(config_path):
    command = [sys.executable, "-m", "cascade_service.cli", "tier", "--config", str(config_path)]
    process = subprocess.Popen([*command, "--tier", "mid", "--tier", "mag"], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert "serving cascade.tier.v1.Tier [mid (sub-cascade), mag]" in line, line
        address = line.split(" on ")[1].split()[0]
        with grpc.insecure_channel(address) as channel:
            info = pb.InfoReply.FromString(channel.unary_unary(f"/{SERVICE}/Info")(b"", timeout=30))
        assert [t.name for t in info.tiers] == ["mid", "mag"] and info.tiers[0].system
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tier", "mid", "--listen", "0.0.0.0:0"], "a non-loopback address is served only with --api-keys"),
        (["--tier", "nope"], "--tier: nope; the config has target, mid, mag"),
        (["--tier", "mid", "--listen", "nope"], "--listen must be HOST:PORT"),
        (["--tier", "mid", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--tier", "mid", "--workers", "0"], "--workers must be in [1, 4096]"),
    ],
)
def test_bad_arguments_are_refused_before_anything_loads(config_path, capsys, args, message):
    assert main(["tier", "--config", str(config_path), *args]) == 2
    assert message in capsys.readouterr().err
