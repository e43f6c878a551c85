"""Running test clients concurrently."""

from __future__ import annotations

import threading


def concurrently(n: int, run) -> None:
    """run(0) ... run(n - 1), each in its own thread, all at once; returns when all are done."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
