"""engine.heap: a serving process's start-up heap frozen out of the cyclic collector's walks. What was alive
at the freeze is in the permanent generation (no collection walks it) and counted on /metrics; what comes
after is collected as before, cycles included."""

from __future__ import annotations

import gc
import weakref

from prometheus_client.parser import text_string_to_metric_families

from cascade_service.engine.heap import freeze_startup_heap
from cascade_service.metrics import default_metrics


class Node:
    def __init__(self) -> None:
        self.peer: Node | None = None


def test_what_was_alive_at_the_freeze_is_left_out_and_what_comes_after_is_collected():
    before = Node()
    try:
        frozen = freeze_startup_heap("test")
        # Frozen objects still die by reference counting (and leave the count): it can only fall since.
        assert frozen > 0 and gc.get_freeze_count() <= frozen
        shown = [
            s.value
            for f in text_string_to_metric_families(default_metrics().exposition().decode())
            for s in f.samples
            if s.name == "cascade:heap_frozen_objects"
        ]
        assert shown == [frozen]  # what /metrics shows
        tracked = {id(o) for o in gc.get_objects()}  # every generation but the permanent one
        assert id(before) not in tracked
        after = Node()
        assert id(after) in {id(o) for o in gc.get_objects()}
        a, b = Node(), Node()  # a cycle made after the freeze: the collector still frees it
        a.peer, b.peer = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()  # the test process's heap goes back to the collector
