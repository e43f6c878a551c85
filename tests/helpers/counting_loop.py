"""An asyncio event loop that counts its cross-thread wake-ups (engine.handoff's tests)."""

from __future__ import annotations

import asyncio


class CountingLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    def call_soon_threadsafe(self, callback, *args, context=None):  # type: ignore[override]
        self.wakeups += 1
        return super().call_soon_threadsafe(callback, *args, context=context)
