"""A tier in this process behind the whole tier wire: the reference transport tests run the cascade
through to show that the codec loses nothing."""

from __future__ import annotations

from ..core.tier import Tier
from ..transport.remote import RemoteTier
from .host import TierHost


def loopback(tier: Tier, request_id: str = "") -> RemoteTier:
    """`tier` behind the wire codec and a `TierHost` in this process: every message it gets and gives
    crosses as bytes, contexts as deltas, as they would to a tier server.

    The reference transport: tests run the cascade through it to show that the codec loses nothing.
    """
    host = TierHost(lambda name, request: tier)

    def invoke(method: str, data: bytes) -> bytes:
        if method == "draft":
            return host.draft(data)
        if method == "review":
            return host.review(data)
        if method == "release":
            tier.release(host.release(data))
            return b""
        raise ValueError(f"method: unknown tier call {method!r}")

    return RemoteTier(tier.name, request_id, invoke, system=tier.system, blocking=False)
