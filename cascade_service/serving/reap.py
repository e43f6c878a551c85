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
from pathlib import Path

log = logging.getLogger(__name__)

PROC = Path("/proc")


def children() -> dict[int, str]:
    """The processes this one started that still run: pid -> start time (a pid reused later is not
    taken for one of them)."""
    return {pid: start for pid, (ppid, start) in _table().items() if ppid == os.getpid()}


def descendants(roots: dict[int, str]) -> dict[int, str]:
    """`roots` still running and every process below them, now (pid -> start time)."""
    table = _table()
    tree = {pid for pid, start in roots.items() if pid in table and table[pid][1] == start}
    grew = True
    while grew:
        below = {pid for pid, (ppid, _) in table.items() if ppid in tree} - tree
        tree |= below
        grew = bool(below)
    return {pid: table[pid][1] for pid in tree}


def _table() -> dict[int, tuple[int, str]]:
    """Every process now: pid -> (parent pid, start time)."""
    table = {}
    for stat in PROC.glob("[0-9]*/stat"):
        fields = _fields(stat)
        if fields is not None:
            table[int(stat.parent.name)] = (int(fields[1]), fields[19])  # after "pid (comm)": ppid, starttime
    return table


def end_leftovers(started: dict[int, str], wait_s: float) -> list[int]:
    """Give the processes of `started` still running up to wait_s to exit, then SIGKILL them; the
    pids killed."""
    deadline = time.monotonic() + wait_s
    while (left := [pid for pid, start in started.items() if _running(pid, start)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        log.warning("ending %s (pid %d): still running after ray.shutdown()", _command(pid), pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _fields(stat: Path) -> list[str] | None:
    """The fields of /proc/PID/stat after the command (which may hold spaces); None once it is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _running(pid: int, start: str) -> bool:
    fields = _fields(PROC / str(pid) / "stat")
    return fields is not None and fields[19] == start and fields[0] not in ("Z", "X")  # a zombie has exited


def _command(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        return "?"
