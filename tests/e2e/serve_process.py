"""Start `cascade-service serve` as a real process for the end-to-end tests, and stop it as an operator does."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from cascade_service import procfs

READY = "serving cascade.v1.CascadeService on"
HTTP_READY = "serving the OpenAI-compatible HTTP API on"


def write_config(path: Path, tiny_family: dict[str, Any], grace_s: float) -> Path:
    raw = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            # Both statistical drafters: MaG inside the K-matrix, suffix decoding behind the gate and
            # in the target's row (issue 37: every wiring runs a config that mixes them).
            "drafters": [{"name": "mid", "path": str(tiny_family["mid"])}, {"kind": "mag"}, {"kind": "suffix"}],
        },
        "schedule": {
            "k_matrix": [[4, 0, 2], [0, 6, 0], [0, 0, 0]],
            "leniency": 1.5,
            "lookup": {"tier": "suffix", "min_match": 2, "tokens": 16},
        },
        "generation": {"max_new_tokens": 16},
        "serving": {"torch_threads": 1, "shutdown_grace_s": grace_s},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


class ServeProcess:
    """`serve --frontend F` on a free loopback port; `address` once it printed that it serves, and
    `http_url` (the OpenAI-compatible API's base URL) with http=True."""

    def __init__(self, config: Path, frontend: str, timeout_s: float = 300.0, http: bool = False):
        # A Ray of its own for the child: it must not join a cluster this test session started.
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cascade_service.cli",
                "serve",
                "--config",
                str(config),
                "--grpc-port",
                "0",
                "--frontend",
                frontend,
                *(["--http-port", "0"] if http else []),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # A group of its own: what it starts (Ray's processes included) is found by its group id,
            # even once reparented, and a stop's test can tell that nothing of the group outlives it.
            process_group=0,
        )
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.process.stderr), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        line = ""
        while READY not in line:
            assert self.process.poll() is None and time.monotonic() < deadline, "".join(self.stderr)[-3000:]
            line = self.process.stdout.readline()
        self.address = line.split(" on ")[1].split()[0]
        self.http_url: str | None = None
        if http:
            line = self.process.stdout.readline()
            assert HTTP_READY in line, line + "".join(self.stderr)[-3000:]
            self.http_url = line.split(" on ")[1].split()[0]

    def tree(self) -> set[int]:
        return tree(self.process.pid)


def tree(pid: int) -> set[int]:
    """The process and every process it started, now."""
    return {pid, *procfs.descendants(pid)}


def left_behind(pids: set[int], wait_s: float = 15.0) -> dict[int, str]:
    """Those of `pids` still running after up to wait_s (zombies count as gone), with their commands."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = {pid: procfs.command(pid) for pid in pids if _running(pid)}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.25)


def group(pgid: int, wait_s: float = 0.0) -> dict[int, str]:
    """The processes of process group `pgid` still running after up to wait_s (zombies count as gone),
    with their commands: a process Ray started and then lost (its parent gone) is still found here."""
    deadline = time.monotonic() + wait_s
    while True:
        members = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):  # after "pid (comm)": state, ppid, pgrp
                members[int(stat.parent.name)] = procfs.command(int(stat.parent.name))
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
