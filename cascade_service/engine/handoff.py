"""What the engine loop hands to an asyncio front end: one wake-up of its event loop per engine step.

A streamed chunk reached its front end by `call_soon_threadsafe`: a write to the event loop's self-pipe
per chunk, and at each write the engine loop's thread let the GIL go to the front end's thread, which
then built and sent that one chunk while the engine's Python waited to take the GIL back. At 64 streams
an engine step hands over 64 chunks, and its updates ran interleaved with 64 such wake-ups. Now the
loop's tasks post their chunks to the event loop's mailbox without waking it, and the loop wakes every
mailbox it posted to once its updates are done (`TaskLoop.step`), as its passes begin: the front end
builds and sends the chunks while the passes compute, which they do without the GIL, instead of
between the engine's own Python. The event loop delivers the items in the order they came, each to
its consumer. A post from any other thread wakes the event loop itself (`Mailbox.post`).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any


class Mailbox:
    """Items for one asyncio event loop, posted from any thread, delivered on the event loop in order."""

    def __init__(self, aloop: asyncio.AbstractEventLoop):
        self._aloop = aloop
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[Any], None], Any]] = []
        self._waking = False  # a drain is scheduled on the event loop and has not yet taken the items

    def post(self, deliver: Callable[[Any], None], item: Any, wake: bool = True) -> None:
        """deliver(item) on the event loop, after every item posted before it (it must not block).
        wake False: the caller wakes the event loop later (`wake`), with what else it posts meanwhile."""
        with self._lock:
            self._items.append((deliver, item))
        if wake:
            self.wake()

    def wake(self) -> None:
        """Have the event loop deliver what is posted, unless it has been asked to and has not yet."""
        with self._lock:
            if self._waking or not self._items:
                return
            self._waking = True
        try:
            self._aloop.call_soon_threadsafe(self._drain)
        except BaseException:  # a closed event loop: the next wake tries again, and fails the same way
            with self._lock:
                self._waking = False
            raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._waking = False
        for deliver, item in items:
            deliver(item)


_BOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_BOXES_LOCK = threading.Lock()


def mailbox(aloop: asyncio.AbstractEventLoop) -> Mailbox:
    """The event loop's mailbox (one per event loop, gone with it)."""
    with _BOXES_LOCK:
        box = _BOXES.get(aloop)
        if box is None:
            box = _BOXES[aloop] = Mailbox(aloop)
        return box
