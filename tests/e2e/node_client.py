"""Run the Node.js cascade.v1 client (tests/e2e/node/client.mjs) against a live server.

The client is written with @grpc/grpc-js and @grpc/proto-loader and loads protos/cascade/v1/cascade.proto
as it is, so what it sees is the contract as a non-Python client sees it. `run_node_client` returns
the JSON object it prints: keys generate, stream, bad_unary, bad_stream, not_found and health (see
client.mjs). Errors are recorded in that object, not raised: the tests make the assertions.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from google.rpc import status_pb2

NODE_DIR = Path(__file__).resolve().parent / "node"
CLIENT = NODE_DIR / "client.mjs"
RUN_TIMEOUT_S = 180.0
INSTALL_TIMEOUT_S = 600.0


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed (the Node.js conformance client needs node and npm)")
    return path


def ensure_installed() -> None:
    """`npm ci` in NODE_DIR unless its node_modules is already there (from package-lock.json)."""
    if (NODE_DIR / "node_modules").is_dir():
        return
    npm = _tool("npm")
    try:
        proc = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            check=False,  # the return code is read below, with npm's output
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"npm ci in {NODE_DIR} timed out after {INSTALL_TIMEOUT_S:.0f} s") from e
    if proc.returncode != 0:
        raise RuntimeError(f"npm ci in {NODE_DIR} failed (exit {proc.returncode}):\n{proc.stderr.strip()}")


def run_node_client(address: str, prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
    """Run client.mjs against `address` (host:port) and return the JSON object it prints."""
    node = _tool("node")
    argv = [node, str(CLIENT), address, ",".join(str(int(t)) for t in prompt), str(int(max_new_tokens))]
    try:
        proc = subprocess.run(argv, check=False, cwd=NODE_DIR, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"node client timed out after {RUN_TIMEOUT_S:.0f} s against {address}") from e
    if proc.returncode != 0:
        raise RuntimeError(f"node client failed (exit {proc.returncode}) against {address}:\n{proc.stderr.strip()}")
    try:
        result: dict[str, Any] = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise RuntimeError(
            f"node client printed no JSON object:\nstdout: {proc.stdout!r}\nstderr: {proc.stderr.strip()}"
        ) from e
    return result


def decode_status(b64: str | None) -> status_pb2.Status | None:
    """The google.rpc.Status in a grpc-status-details-bin trailer as client.mjs reports it (base64)."""
    if b64 is None:
        return None
    status = status_pb2.Status()
    status.ParseFromString(base64.b64decode(b64))
    return status
