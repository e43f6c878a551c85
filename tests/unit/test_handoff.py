"""The engine loop's hand-off to an asyncio front end (engine.handoff): a burst of items from another
thread wakes the event loop once, and every item arrives, in order, to its own consumer."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cascade_service.engine.handoff import Mailbox, mailbox

from ..helpers.counting_loop import CountingLoop


def test_a_burst_from_another_thread_wakes_the_event_loop_once_and_arrives_in_order():
    aloop = CountingLoop()
    try:
        box = Mailbox(aloop)
        got: dict[str, list[int]] = {"a": [], "b": []}
        # While a drain is pending, later posts ride along: one wake-up however many arrive.
        burst = threading.Thread(target=lambda: [box.post(got["ab"[i % 2]].append, i) for i in range(64)])
        burst.start()
        burst.join()
        assert aloop.wakeups == 1
        aloop.run_until_complete(asyncio.sleep(0))
        assert got == {"a": list(range(0, 64, 2)), "b": list(range(1, 64, 2))}
        # Posted without waking (the engine loop's own posts): nothing until `wake`, then one wake-up.
        box.post(got["a"].append, 64, wake=False)
        box.post(got["b"].append, 65, wake=False)
        aloop.run_until_complete(asyncio.sleep(0))
        assert aloop.wakeups == 1 and got["a"][-1] == 62
        box.wake()
        box.wake()
        aloop.run_until_complete(asyncio.sleep(0))
        assert aloop.wakeups == 2 and got["a"][-1] == 64 and got["b"][-1] == 65
        box.wake()  # nothing posted since the drain: nothing to wake for
        assert aloop.wakeups == 2
    finally:
        aloop.close()


def test_a_closed_event_loop_fails_every_post_instead_of_dropping_it():
    aloop = asyncio.new_event_loop()
    aloop.close()
    box = Mailbox(aloop)
    for item in (1, 2):  # the second post tries to wake the loop again, and fails as loudly
        with pytest.raises(RuntimeError, match="closed"):
            box.post(print, item)


def test_each_event_loop_has_one_mailbox():
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert mailbox(first) is mailbox(first) and mailbox(first) is not mailbox(second)
    finally:
        first.close()
        second.close()
