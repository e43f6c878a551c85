"""`cascade-service serve` as a real process: prints its address, answers `cascade-service client`,
and stops cleanly on Ctrl-C (SIGINT) with exit status 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import yaml


def test_serve_prints_its_address_answers_clients_and_stops_on_ctrl_c(tiny_family, tmp_path):
    raw = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [{"name": "close", "path": str(tiny_family["close"])}, {"kind": "mag"}],
        },
        "schedule": {"k_matrix": [[3, 0], [0, 5]]},
    }
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(raw))
    cli = [sys.executable, "-m", "cascade_service.cli"]
    # A separate Ray for the child: it must not join the test session's cluster.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [*cli, "serve", "--config", str(config), "--grpc-port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "serving cascade.v1.CascadeService on" not in line:
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read() if proc.poll() is not None else "timeout"
            )
            line = proc.stdout.readline()
        address = line.split(" on ")[1].split()[0]
        assert address.startswith("127.0.0.1:")
        out = subprocess.run(
            [*cli, "client", "generate", "--target", address, "--prompt", "x", "--max-new-tokens", "6", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["token_ids"]) == 6
        bad = subprocess.run(
            [*cli, "client", "generate", "--target", address, "--prompt", "x", "--max-new-tokens", "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "max_new_tokens" in bad.stderr
        streamed = subprocess.run(
            [*cli, "client", "stream", "--target", address, "--prompt", "x", "--max-new-tokens", "6", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        chunks = [json.loads(line) for line in streamed.stdout.splitlines()]
        assert [t for c in chunks for t in c["token_ids"]] == json.loads(out.stdout)["token_ids"]
        assert chunks[-1]["finish_reason"] == "length"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, proc.stderr.read()
