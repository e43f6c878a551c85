"""A command's own lines on the terminal, everything else in a log file under the home.

Third-party output reaches the terminal by several roads: Python loggers (Ray's token-authentication
warning, Ray Serve's INFO lines) and `warnings` write to the `sys.stderr` they were made with; Ray's C++
core and gRPC (absl) write to file descriptor 2 directly; a child process inherits descriptors 1 and 2.
Only a redirect of the descriptors themselves catches all of them, so `third_party_output` points 1 and 2
at the log for the length of a block and hands the command a stream of its own on the terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from .paths import home

# Lines of the log shown when a command fails: enough for a Python traceback with Ray's line before it.
TAIL_LINES = 40
_TAIL_BYTES = 64 * 1024  # read no more than this from the end of a long log to find those lines


def log_path(command: str) -> Path:
    """A new log's path for one run of `command`: <home>/logs/<command>-<date>-<time>-<pid>.log (the pid:
    two runs started in the same second get two files)."""
    return home() / "logs" / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


@contextlib.contextmanager
def third_party_output(path: Path | None) -> Iterator[TextIO]:
    """Send descriptors 1 and 2 to the log at `path` while the block runs; yield the stream for the
    command's own lines (the terminal's stdout). On an error the log's tail and its path go to the
    terminal's stderr before the error propagates (its traceback then prints there as usual).
    path None: nothing is redirected and sys.stdout is yielded (`--verbose`: everything on the terminal).
    """
    if path is None:
        yield sys.stdout
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    terminal = open(os.dup(saved[1]), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    try:
        with open(path, "ab", buffering=0) as log:
            log.write(f"# third-party output of process {os.getpid()}, from {time.strftime('%H:%M:%S')}\n".encode())
            for fd in (1, 2):
                os.dup2(log.fileno(), fd)
            try:
                yield terminal
            finally:
                _flush()  # what Python buffered while redirected belongs to the log, not the terminal
                for fd, copy in saved.items():
                    os.dup2(copy, fd)
    except BaseException as exc:
        _report(path, exc)
        raise
    finally:
        terminal.close()
        for copy in saved.values():
            os.close(copy)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or replaced stream has nothing of ours
            stream.flush()


def _report(path: Path, exc: BaseException) -> None:
    """On the terminal's stderr: where the third-party logs are, and their last lines unless the user
    interrupted (a Ctrl-C needs no diagnosis)."""
    if isinstance(exc, Exception) and path.exists():
        print(f"the run failed; the last lines of its third-party logs ({path}):", file=sys.stderr)
        for line in tail(path, TAIL_LINES):
            print(f"  | {line}", file=sys.stderr)
    print(f"third-party logs: {path}", file=sys.stderr, flush=True)


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a text file (read from its end: a log may be long)."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace").splitlines()[-lines:]
