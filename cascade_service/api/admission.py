"""What a front end admits (`Limits`), how it refuses (`Refused`), an admitted call's cancel hooks, and
the workers admitted calls wait for (`Workers`)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from ..metrics import default_metrics
from ..sessions.store import MAX_SESSION_TOKENS
from .parse import decode
from .status import DETAILS_KEY, rich_status, set_status, too_large

log = logging.getLogger(__name__)


# The largest request by default: a CreateSession carrying a session's whole limit of token ids (a
# packed int32 takes at most 5 bytes), with room for the rest of the message.
MAX_REQUEST_BYTES = 5 * MAX_SESSION_TOKENS + (64 << 10)


@dataclass(frozen=True)
class Limits:
    """What a front end admits. See the module docstring for the order in which they apply.

    workers: calls served at once (each a decode in the engine loop, or a thread that waits on a remote
    coordinator); max_queued: admitted calls waiting for a worker; max_pending: calls whose body has
    not arrived yet, over all connections;
    max_calls_per_key: calls open at once under one API key (with keys configured);
    max_streams_per_connection: calls open at once on one HTTP/2 connection; body_timeout_s: the time a
    request body (or the next message of a reflection stream) may take to arrive; max_probes: health
    and reflection calls open at once (a Watch stays open); max_message_bytes: the largest request message.
    """

    workers: int = 8
    max_queued: int = 64
    max_pending: int = 1024
    max_calls_per_key: int = 64
    max_streams_per_connection: int = 100
    body_timeout_s: float = 10.0
    max_probes: int = 256
    max_message_bytes: int = MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        for name in ("workers", "max_pending", "max_calls_per_key", "max_streams_per_connection", "max_probes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if not 0 < self.body_timeout_s <= 3600:
            raise ValueError(f"body_timeout_s must be in (0, 3600], got {self.body_timeout_s}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")


def limits_from(settings: Mapping[str, float], **defaults: Any) -> Limits:
    """Limits from a config's serving.admission over the wiring's `defaults`; ValueError naming the
    setting (serving.admission.<key>) when one is out of range."""
    try:
        return Limits(**{**defaults, **settings})
    except ValueError as exc:
        raise ValueError(f"serving.admission.{exc}") from None


def within_limit(request: Any, limit: int, grpc_context: Any) -> bool:
    """Whether a request message is within `limit` bytes (Limits.max_message_bytes). gRPC checks that on
    receipt on the servers we start; Ray's proxy takes up to 2 GiB, so the coordinator checks its calls
    here. Past it, the context gets RESOURCE_EXHAUSTED naming the limit, with no retry hint."""
    if (size := request.ByteSize()) <= limit:
        return True
    set_status(grpc_context, grpc.StatusCode.RESOURCE_EXHAUSTED, too_large(size, limit))
    return False


class Refused(Exception):
    """A call ends with this status before (or instead of) any work."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class CallHooks:
    """One admitted call's cancel hooks: the client hung up, its deadline passed, or the server stops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancels: list[Callable[[], None]] = []
        self.ended = False
        self.stopped = False  # ended by the server's stop, not by the client

    def on_end(self, cancel: Callable[[], None]) -> bool:
        with self._lock:
            if self.ended:
                return False
            self._cancels.append(cancel)
            return True

    def end(self, stopped: bool = False) -> None:
        with self._lock:
            if self.ended:
                return
            self.ended, self.stopped = True, stopped
            cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            try:
                cancel()
            except Exception:
                log.debug("cancel failed", exc_info=True)


def decode_body(kind: Any, body: bytes) -> Any:
    try:
        return decode(kind, body)
    except ValueError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def time_left(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds to the client's deadline; None without one (gRPC then reports about 1e308 seconds,
    which overflows any timer it is handed to)."""
    left = context.time_remaining()
    return None if left is None or left > 10**7 else max(left, 0.0)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End the call with code, message and the rich details trailer (raises, as context.abort does)."""
    trailer = ((DETAILS_KEY, rich_status(code, message).SerializeToString()),)
    await context.abort(code, message, trailing_metadata=trailer)


class Workers:
    """A front end's workers and the admitted calls waiting for one; used on the front end's loop.

    `take()` returns once the caller holds a worker, RESOURCE_EXHAUSTED when `max_queued` calls wait
    already; `release()` hands the worker to the call that waited longest, or back to the pool. The
    number waiting is `cascade:num_requests_waiting`, set at each change (Ray's metrics take pushed
    values, not callbacks)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.free = limits.workers
        self.waiting: deque[asyncio.Future] = deque()
        self._count()

    async def take(self) -> None:
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return
        if len(self.waiting) >= self.limits.max_queued:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is at its limit ({self.limits.workers} calls running, "
                f"{self.limits.max_queued} waiting); retry later",
            )
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        self._count()
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # handed a worker just as the caller left: pass it on
            else:
                self.waiting.remove(turn)
                self._count()
            raise

    def release(self) -> None:
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                break
        else:
            self.free += 1
        self._count()

    def _count(self) -> None:
        default_metrics().waiting.set(len(self.waiting))
