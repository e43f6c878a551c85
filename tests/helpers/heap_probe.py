"""Run as `python -m tests.helpers.heap_probe` (tests/unit/test_heap.py): freezes this process's heap as a
serving process does and checks what the collector still walks. Its own process, because a freeze (and
the unfreeze after it) reorders the test runner's collector generations for every later test: garbage
cycles of theirs would wait for interpreter shutdown to be collected, with modules half torn down."""

from __future__ import annotations

import gc
import weakref

from prometheus_client.parser import text_string_to_metric_families

from cascade_service.engine.heap import freeze_startup_heap
from cascade_service.metrics import default_metrics


class Node:
    def __init__(self) -> None:
        self.peer: Node | None = None


def main() -> None:
    before = Node()
    frozen = freeze_startup_heap("test")
    # Frozen objects still die by reference counting (and leave the count): it can only fall since.
    assert frozen > 0 and gc.get_freeze_count() <= frozen, (frozen, gc.get_freeze_count())
    shown = [
        s.value
        for f in text_string_to_metric_families(default_metrics().exposition().decode())
        for s in f.samples
        if s.name == "cascade:heap_frozen_objects"
    ]
    assert shown == [frozen], shown  # what /metrics shows
    tracked = {id(o) for o in gc.get_objects()}  # every generation but the permanent one
    assert id(before) not in tracked, "an object alive at the freeze is still walked"
    after = Node()
    assert id(after) in {id(o) for o in gc.get_objects()}, "an object made after the freeze is not walked"
    a, b = Node(), Node()  # a cycle made after the freeze: the collector still frees it
    a.peer, b.peer = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None, "a cycle made after the freeze was not collected"
    print("heap probe: ok", frozen)


if __name__ == "__main__":
    main()
