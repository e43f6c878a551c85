"""What a local Ray leaves behind: the processes ray.init started and every process below them, found
before ray.shutdown() and ended if they outlive it.

ray.shutdown() gives the raylet 1 s to exit on SIGTERM, then kills it; the raylet's agents
(`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) notice their parent is gone only by polling, and then
report its death to a GCS that has gone too. After a heavy hostile run both were still running once
`serve` had exited (issue 48). Only those processes are ended, each checked by its start time: never a
process group, which `serve` may share with whatever started it, nor another child of this process
(a test's Redis server beside an in-process service).
"""

from __future__ import annotations

import logging
import os
import signal
import time

from ..procfs import command, processes, stat_fields
from ..procfs import descendants as procfs_descendants

log = logging.getLogger(__name__)


def children() -> dict[int, str]:
    """The processes this one started that still run: pid -> start time (a pid reused later is not
    taken for one of them)."""
    return {pid: start for pid, (ppid, start) in processes().items() if ppid == os.getpid()}


def descendants(roots: dict[int, str]) -> dict[int, str]:
    """`roots` still running and every process below them, now (pid -> start time)."""
    table = processes()
    live = [pid for pid, start in roots.items() if pid in table and table[pid][1] == start]
    return {pid: table[pid][1] for pid in procfs_descendants(*live) if pid in table}


def end_leftovers(started: dict[int, str], wait_s: float) -> list[int]:
    """Give the processes of `started` still running up to wait_s to exit, then SIGKILL them; the
    pids killed."""
    deadline = time.monotonic() + wait_s
    while (left := [pid for pid, start in started.items() if _running(pid, start)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        log.warning("ending %s (pid %d): still running after ray.shutdown()", command(pid), pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _running(pid: int, start: str) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[19] == start and fields[0] not in ("Z", "X")  # a zombie has exited
