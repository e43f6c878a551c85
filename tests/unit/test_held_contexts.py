"""The server keeps each request's last context per tier and rebuilds a call's whole context from it."""

from __future__ import annotations

from cascade_service.core.types import Context
from cascade_service.tierhost.host import HeldContexts
from cascade_service.transport.codec import Address, prefix_digest


def _call(held: HeldContexts, tokens: list[int], offset: int, rid: str = "r", tier: str = "t") -> Context | None:
    address = Address(tier, offset, prefix_digest(tokens[:offset]) if offset else 0)
    return held.resolve(address, rid, Context(tokens[offset:], len(tokens)))


def test_a_delta_is_joined_to_the_held_prefix():
    held = HeldContexts()
    assert _call(held, [1, 2, 3], 0) == Context([1, 2, 3], 3)
    assert _call(held, [1, 2, 3, 4, 5], 3) == Context([1, 2, 3, 4, 5], 5)
    assert _call(held, [1, 2, 3, 4, 9], 4) == Context([1, 2, 3, 4, 9], 5)  # a rejected draft token replaced


def test_a_prefix_not_held_asks_for_a_resend():
    held = HeldContexts()
    assert _call(held, [1, 2, 3], 2) is None  # nothing held: a restart, another replica
    _call(held, [1, 2, 3], 0)
    assert _call(held, [1, 2, 7, 8], 3) is None  # held [1, 2, 3], the caller meant [1, 2, 7]
    assert _call(held, [1, 2, 3, 4, 5, 6], 5) is None  # longer than what is held
    assert _call(held, [1, 2, 3, 4], 3, tier="other") is None  # each tier holds its own
    assert _call(held, [1, 2, 3, 4], 3, rid="other") is None
    assert held.resends == 5


def test_release_forgets_and_the_oldest_requests_go_first():
    held = HeldContexts(max_requests=2)
    for rid in ("a", "b", "c"):
        _call(held, [1, 2], 0, rid=rid)
    assert len(held) == 2
    assert _call(held, [1, 2, 3], 2, rid="a") is None  # evicted
    assert held.release("c") and not held.release("c")
