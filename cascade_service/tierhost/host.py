"""The serving side of the tier protocol over bytes: decode a call, rebuild its context, run it, encode.

Every transport ends here: the gRPC tier server (`tierhost.server`), a Ray tier deployment
(`tierhost.group.TierGroup`) and the in-process loopback (`tierhost.loopback`). A call carries
only the context tokens the server does not hold yet (`transport.codec.Address`); `HeldContexts`
keeps each request's last context per tier and puts the two together, or says "resend" when what it
holds is not the prefix the caller meant (a restart, a failover to another replica, an eviction).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from ..core.tier import DraftRequest, Release, ReviewRequest, Tier
from ..core.types import Context
from ..transport.codec import (
    RESEND,
    Address,
    decode_draft_request,
    decode_release,
    decode_review_request,
    encode_draft_reply,
    encode_review_reply,
    prefix_digest,
)

MAX_HELD_REQUESTS = 256  # requests whose contexts a server keeps; beyond it the least recently used go

Call = TypeVar("Call", DraftRequest, ReviewRequest)
# (tier name, the call with its whole context) -> the tier that serves it. Raises UnknownTier for a
# tier the server does not host, ValueError for a call the tier cannot take (naming the field).
Route = Callable[[str, "DraftRequest | ReviewRequest"], Tier]


class UnknownTier(LookupError):
    """A call names a tier this server does not host."""


class HeldContexts:
    """The whole context of each request's last call, per tier, for its requests' next calls (LRU)."""

    def __init__(self, max_requests: int = MAX_HELD_REQUESTS):
        self.max_requests = max_requests
        self._held: OrderedDict[str, dict[str, list[int]]] = OrderedDict()
        self._lock = threading.Lock()
        self.resends = 0  # calls answered "resend": the prefix they named was not held

    def resolve(self, address: Address, request_id: str, delta: Context) -> Context | None:
        """The call's whole context, or None when the prefix it names is not the one held."""
        with self._lock:
            held = self._held.get(request_id, {}).get(address.tier)
        if address.offset:
            if held is None or len(held) < address.offset or prefix_digest(held[: address.offset]) != address.prefix:
                with self._lock:
                    self.resends += 1
                return None
            tokens = held[: address.offset] + delta.tokens
        else:
            tokens = list(delta.tokens)
        with self._lock:
            tiers = self._held.pop(request_id, {})
            tiers[address.tier] = tokens
            self._held[request_id] = tiers  # most recently used last
            while len(self._held) > self.max_requests:
                self._held.popitem(last=False)
        return Context(tokens, delta.stable)

    def release(self, request_id: str) -> bool:
        with self._lock:
            return self._held.pop(request_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class TierHost:
    """Serves encoded tier calls: `route` picks the tier for each (after its context is whole)."""

    def __init__(self, route: Route, max_requests: int = MAX_HELD_REQUESTS):
        self.route = route
        self.contexts = HeldContexts(max_requests)

    def draft(self, data: bytes) -> bytes:
        """A DraftRequest -> a DraftReply (or `RESEND`)."""
        address, request = decode_draft_request(data)
        whole = self._whole(address, request)
        if whole is None:
            return RESEND["draft"]
        return encode_draft_reply(self.route(address.tier, whole).draft(whole))

    def review(self, data: bytes) -> bytes:
        """A ReviewRequest -> a ReviewReply (or `RESEND`)."""
        address, request = decode_review_request(data)
        whole = self._whole(address, request)
        if whole is None:
            return RESEND["review"]
        return encode_review_reply(self.route(address.tier, whole).review(whole))

    def release(self, data: bytes) -> Release:
        """A ReleaseRequest: forget the request's contexts; returns it, with its final tokens whole
        where it carried them and the prefix they build on is held (the caller frees the rest)."""
        address, release = decode_release(data)
        if address is not None:
            whole = self.contexts.resolve(address, release.request_id, Context(list(release.tokens), 0))
            release = replace(release, tokens=tuple(whole.tokens) if whole is not None else ())
        self.contexts.release(release.request_id)
        return release

    def _whole(self, address: Address, request: Call) -> Call | None:
        context = self.contexts.resolve(address, request.request_id, request.context)
        return None if context is None else replace(request, context=context)
