"""serving.reap: the processes a Ray start left are found by pid and start time, with what is below
them, and ended when they outlive their wait; nothing else is touched."""

from __future__ import annotations

import subprocess
import sys
import time

from cascade_service.serving import reap

# A child that starts a grandchild, then waits: a raylet and its agents in small.
SLEEP = "import time; time.sleep(60)"
PARENT = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {SLEEP!r}]); time.sleep(60)"


def test_leftovers_and_what_is_below_them_are_ended_and_nothing_else():
    before = reap.children()
    started = subprocess.Popen([sys.executable, "-c", PARENT])
    bystander = subprocess.Popen([sys.executable, "-c", SLEEP])  # a test's Redis
    try:
        deadline = time.monotonic() + 10
        while len(tree := reap.descendants({started.pid: reap.children()[started.pid]})) < 2:
            assert time.monotonic() < deadline, "the grandchild did not start"
            time.sleep(0.05)
        assert started.pid in tree and bystander.pid not in tree
        recorded = {pid: start for pid, start in reap.children().items() if pid == started.pid and pid not in before}
        killed = reap.end_leftovers(reap.descendants(recorded), wait_s=0.2)
        assert sorted(killed) == sorted(tree)
        assert started.wait(timeout=5) == -9
        assert bystander.poll() is None  # not a Ray process: left alone
        # A pid whose start time differs is another process (the pid was reused): never ended.
        assert reap.end_leftovers({bystander.pid: "0"}, wait_s=0.0) == []
        assert bystander.poll() is None
    finally:
        for process in (started, bystander):
            process.kill()
            process.wait()
