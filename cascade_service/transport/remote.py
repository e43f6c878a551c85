"""The coordinator's side of a tier in another process: `core.tier.Tier` over a byte transport.

`invoke(method, data) -> data` is all it knows of the transport (a Ray Serve deployment handle in
`serving.app`, a gRPC channel in `transport.client`, a direct call in tests); what it sends and
receives is `transport.codec`'s encoding of `core.tier`'s messages. A call carries the context tokens
after what it sent last time (the server kept those, `tierhost.host`); a server that holds something
else (another replica answered, it restarted) answers "resend" and gets the whole context, from which
it rebuilds its KV cache. So a replica change costs one prefill and never changes a token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ..core.stats import Usage
from ..core.tier import DraftReply, DraftRequest, Release, ReviewReply, ReviewRequest
from ..engine.loop import run_blocking
from .codec import (
    decode_draft_reply,
    decode_review_reply,
    encode_draft_request,
    encode_release,
    encode_review_request,
)

log = logging.getLogger(__name__)

Invoke = Callable[[str, bytes], bytes]
Reply = TypeVar("Reply", DraftReply, ReviewReply)


class TierProtocolError(RuntimeError):
    """The server broke the protocol (asked for the whole context after it got it)."""


class RemoteTier:
    """One request's view of a remote tier (implements `core.tier.Tier`).

    `system`: the replica runs this tier's whole sub-cascade for a draft (configured at deployment;
    `tierhost.group.TierGroup`); its reply's usage then covers every tier inside. `blocking`: `invoke`
    waits on another process, so in an engine loop task it runs on the loop's executor while the task
    is parked (engine.loop.run_blocking) and the loop's other requests go on.
    """

    def __init__(self, name: str, request_id: str, invoke: Invoke, system: bool = False, blocking: bool = True):
        self.name = name
        self.request_id = request_id
        self.invoke = invoke
        self.system = system
        self.blocking = blocking
        self.hops = 0
        self.hop_s = 0.0  # wall time of calls, transport included
        self.resends = 0  # calls the server asked to send again with the whole context
        self.bytes_out = 0  # request bytes sent, resends included
        self.bytes_in = 0
        # Token ids that had to cross (new context tokens and blocks out, drafts and verdicts back): what
        # bytes_out + bytes_in are weighed against (bench.transport).
        self.ids_out = 0
        self.ids_in = 0
        self._sent: list[int] = []  # the context of the last call that succeeded: the server holds it

    def draft(self, request: DraftRequest) -> DraftReply:
        start = time.perf_counter()
        reply = self._call("draft", request, encode_draft_request, decode_draft_reply)
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
        reply = self._call("review", request, encode_review_request, decode_review_reply)
        self._hop(reply.usage, time.perf_counter() - start)
        return reply

    def _call(
        self,
        method: str,
        request: DraftRequest | ReviewRequest,
        encode: Callable[..., bytes],
        decode: Callable[[bytes], Reply | None],
    ) -> Reply:
        tokens = request.context.tokens
        offset = _common_prefix(self._sent, tokens)
        reply = decode(self._invoke(method, encode(request, self.name, offset)))
        if reply is None and offset:  # the server holds another prefix: send it all
            self.resends += 1
            reply = decode(self._invoke(method, encode(request, self.name, 0)))
        if reply is None:
            raise TierProtocolError(f"tier {self.name!r} asked for the whole context after getting it")
        self._sent = list(tokens)
        self.ids_out += len(tokens) - offset + (len(request.block) if isinstance(request, ReviewRequest) else 0)
        self.ids_in += len(reply.draft) if isinstance(reply, DraftReply) else 2  # a verdict: count and token
        return reply

    def _invoke(self, method: str, data: bytes) -> bytes:
        self.bytes_out += len(data)
        reply = run_blocking(self.invoke, method, data) if self.blocking else self.invoke(method, data)
        self.bytes_in += len(reply)
        return reply

    def release(self, request: Release) -> None:
        """Free the replica's cache of this request; fire and forget (the replica's LRU backs it up)."""
        if not self.hops:
            return  # never called: the replica holds nothing for it
        try:
            data = encode_release(request, self.name, _common_prefix(self._sent, list(request.tokens)))
            run_blocking(self.invoke, "release", data) if self.blocking else self.invoke("release", data)
        except Exception:
            log.warning("could not release tier %s for request %s", self.name, request.request_id)

    def _hop(self, usage: Usage, elapsed: float) -> None:
        self.hops += 1
        self.hop_s += elapsed
        counters = usage.tier(self.name)
        counters.hops += 1
        if not self.system:  # a model tier's time is the call's wall time, transport included
            counters.time_s = elapsed


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (the context grew): one comparison in C
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
