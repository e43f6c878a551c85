"""Running test clients concurrently."""

from __future__ import annotations

import threading
import time


def concurrently(n: int, run) -> None:
    """run(0) ... run(n - 1), each in its own thread, all at once; returns when all are done."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def soon(check, timeout_s: float = 10.0) -> bool:
    """Whether `check()` comes true within `timeout_s` (polled every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
