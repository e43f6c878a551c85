"""The coordinator's side of a tier in another process: `core.tier.Tier` over a byte transport.

`invoke(method, data) -> data` is all it knows of the transport (a Ray Serve deployment handle in
`serving.app`, a direct call in tests); what it sends and receives is `transport.codec`'s encoding of
`core.tier`'s messages. Each call carries the full context: the replica that answers may not be the
one that answered last round, and the context lets it rebuild its KV cache (see `serving.tier`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..core.stats import Usage
from ..core.tier import DraftReply, DraftRequest, Release, ReviewReply, ReviewRequest, Tier
from .codec import (
    decode_draft_reply,
    decode_draft_request,
    decode_release,
    decode_review_reply,
    decode_review_request,
    encode_draft_reply,
    encode_draft_request,
    encode_release,
    encode_review_reply,
    encode_review_request,
)

log = logging.getLogger(__name__)

Invoke = Callable[[str, bytes], bytes]


class RemoteTier:
    """One request's view of a remote tier (implements `core.tier.Tier`).

    `system`: the replica runs this tier's whole sub-cascade for a draft (configured at deployment;
    `serving.tier.TierGroup`); its reply's usage then covers every tier inside.
    """

    def __init__(self, name: str, request_id: str, invoke: Invoke, system: bool = False):
        self.name = name
        self.request_id = request_id
        self.invoke = invoke
        self.system = system
        self.hops = 0
        self.hop_s = 0.0  # wall time of calls, transport included

    def draft(self, request: DraftRequest) -> DraftReply:
        start = time.perf_counter()
        reply = decode_draft_reply(self.invoke("draft", encode_draft_request(request, self.name)))
        self._hop(reply.usage, time.perf_counter() - start)
        reply.draft.origins = [self.name] * len(reply.draft)
        return reply

    def review(self, request: ReviewRequest) -> ReviewReply:
        if request.hidden:
            raise ValueError(
                f"adaptive draft length for reviewing tier {self.name!r} needs its model in this "
                "process (or its whole sub-cascade in its replica)"
            )
        start = time.perf_counter()
        reply = decode_review_reply(self.invoke("review", encode_review_request(request, self.name)))
        self._hop(reply.usage, time.perf_counter() - start)
        return reply

    def release(self, request: Release) -> None:
        """Free the replica's cache of this request; fire and forget (the replica's LRU backs it up)."""
        if not self.hops:
            return  # never called: the replica holds nothing for it
        try:
            self.invoke("release", encode_release(request))
        except Exception:
            log.warning("could not release tier %s for request %s", self.name, request.request_id)

    def _hop(self, usage: Usage, elapsed: float) -> None:
        self.hops += 1
        self.hop_s += elapsed
        counters = usage.tier(self.name)
        counters.hops += 1
        if not self.system:  # a model tier's time is the call's wall time, transport included
            counters.time_s = elapsed


def loopback(tier: Tier, request_id: str = "") -> RemoteTier:
    """`tier` behind the wire codec in this process: every message it gets and gives crosses as bytes.

    The reference transport: tests run the cascade through it to show that the codec loses nothing.
    """

    def invoke(method: str, data: bytes) -> bytes:
        if method == "draft":
            return encode_draft_reply(tier.draft(decode_draft_request(data)[1]))
        if method == "review":
            return encode_review_reply(tier.review(decode_review_request(data)[1]))
        if method == "release":
            tier.release(decode_release(data))
            return b""
        raise ValueError(f"method: unknown tier call {method!r}")

    return RemoteTier(tier.name, request_id, invoke, system=tier.system)
