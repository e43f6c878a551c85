"""In-process session store: one dict behind one lock. For tests, single-replica runs, and as the
reference behaviour the Redis store must match."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from cascade_service.sessions.store import (
    MAX_SESSION_TOKENS,
    SessionConflict,
    SessionExists,
    SessionNotFound,
    SessionQuotaExceeded,
    SessionRecord,
    check_owner,
    check_quota,
    check_session_id,
    check_token_ids,
    check_version,
    new_session_id,
    too_long,
)


class MemoryStore:
    """SessionStore in a dict. `ttl_s` (None: forever) counts from creation and from each append;
    `max_sessions_per_owner` (None: no limit) bounds the live sessions of one owner (API key)."""

    def __init__(self, ttl_s: float | None = None, max_sessions_per_owner: int | None = None) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s!r}")
        self._ttl_s = ttl_s
        self._quota = check_quota(max_sessions_per_owner)
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[SessionRecord, float]] = {}  # id -> (record, expires_at)
        self._next_sweep = 0.0

    def create(self, token_ids: Sequence[int] = (), session_id: str | None = None, owner: str = "") -> SessionRecord:
        tokens = check_token_ids(token_ids)
        session_id = new_session_id() if session_id is None else session_id
        check_session_id(session_id)
        record = SessionRecord(session_id, tokens, 0, check_owner(owner))
        with self._lock:
            now = time.monotonic()
            self._sweep(now)
            if self._live(session_id, now) is not None:
                raise SessionExists(f"session {session_id!r} already exists")
            if self._quota is not None and self._owned(record.owner, now) >= self._quota:
                raise SessionQuotaExceeded(self._quota)
            self._sessions[session_id] = (record, self._expiry(now))
        return record

    def get(self, session_id: str) -> SessionRecord:
        check_session_id(session_id)
        with self._lock:
            record = self._live(session_id, time.monotonic())
        if record is None:
            raise SessionNotFound(session_id)
        return record

    def append(self, session_id: str, token_ids: Sequence[int], expected_version: int) -> SessionRecord:
        check_session_id(session_id)
        tokens = check_token_ids(token_ids)
        check_version(expected_version)
        with self._lock:
            now = time.monotonic()
            record = self._live(session_id, now)
            if record is None:
                raise SessionNotFound(session_id)
            if record.version != expected_version:
                raise SessionConflict(f"session {session_id!r} is at version {record.version}, not {expected_version}")
            length = len(record.token_ids) + len(tokens)
            if length > MAX_SESSION_TOKENS:
                raise too_long(session_id, length)
            record = SessionRecord(session_id, record.token_ids + tokens, record.version + 1, record.owner)
            self._sessions[session_id] = (record, self._expiry(now))
        return record

    def delete(self, session_id: str) -> bool:
        check_session_id(session_id)
        with self._lock:
            existed = self._live(session_id, time.monotonic()) is not None
            self._sessions.pop(session_id, None)
        return existed

    def ping(self) -> None:
        return None

    # Callers hold self._lock.

    def _expiry(self, now: float) -> float:
        return float("inf") if self._ttl_s is None else now + self._ttl_s

    def _live(self, session_id: str, now: float) -> SessionRecord | None:
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._sessions[session_id]
            return None
        return entry[0]

    def _owned(self, owner: str, now: float) -> int:
        return sum(1 for record, expires_at in self._sessions.values() if record.owner == owner and expires_at > now)

    def _sweep(self, now: float) -> None:
        # Lazy expiry alone would keep sessions nobody touches again forever; a full sweep at most once
        # per TTL (on create, the only call that grows the dict) bounds that at O(1) amortized per create.
        if self._ttl_s is None or now < self._next_sweep:
            return
        expired = [sid for sid, (_, expires_at) in self._sessions.items() if expires_at <= now]
        for sid in expired:
            del self._sessions[sid]
        self._next_sweep = now + self._ttl_s
