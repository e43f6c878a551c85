"""Processes that serve gRPC also fork (Ray starts its GCS, raylets and workers with fork + exec):
importing cascade_service turns gRPC's fork handlers off, so a child never runs gRPC between fork and
exec (CI once saw ray.init wait 30 s for a GCS that never started)."""

from __future__ import annotations

import os
import subprocess
import sys

# Threads keep calling into gRPC while the process forks 100 children the way Ray does (Popen with a
# preexec_fn); anything a child or gRPC's fork handlers print lands on stderr.
SCRIPT = """
import subprocess, sys, threading
if sys.argv[1] == "ours":
    import cascade_service  # noqa: F401
import grpc
channel = grpc.insecure_channel("127.0.0.1:1")
done = threading.Event()
def spin():
    while not done.is_set():
        try:
            grpc.channel_ready_future(channel).result(timeout=0.01)
        except Exception:
            pass
threads = [threading.Thread(target=spin) for _ in range(4)]
for t in threads:
    t.start()
for _ in range(100):
    subprocess.Popen(["true"], preexec_fn=lambda: None).wait()
done.set()
for t in threads:
    t.join()
"""


def _stderr_lines(mode: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stderr.splitlines()


def test_a_process_that_imports_cascade_service_forks_without_grpc_in_the_child():
    assert _stderr_lines("ours") == []


def test_without_it_grpc_runs_fork_handlers_in_such_a_process():
    # The control: the same script without our import shows gRPC at work around the forks (its
    # "skipping fork() handlers" notice, or a child's poller errors); if gRPC ever stops doing that by
    # default, this fails and the setting in cascade_service/__init__.py can go.
    lines = _stderr_lines("plain")
    assert any("fork" in line or "epoll" in line or "Bad file descriptor" in line for line in lines), lines
