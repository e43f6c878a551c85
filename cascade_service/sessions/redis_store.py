"""Redis session store: sessions shared by every replica, and surviving service restarts.

Each session is one hash at `{namespace}:session:{id}`: `tokens` (packed little-endian uint32 bytes,
never pickle: a session is client data), `version`, `owner`. Create and append are Lua scripts, so
each is one atomic step on the server whatever other replicas do at the same time.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cascade_service.sessions.store import (
    MAX_SESSION_TOKENS,
    SessionConflict,
    SessionError,
    SessionExists,
    SessionNotFound,
    SessionQuotaExceeded,
    SessionRecord,
    StoreUnavailable,
    check_owner,
    check_quota,
    check_session_id,
    check_token_ids,
    check_version,
    new_session_id,
    too_long,
)

# No ':' in a namespace: otherwise namespace "a:session" with id "x" and namespace "a" with id
# "session:x" would share a key.
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

# KEYS[1] session key, KEYS[2] the owner's set of session ids; ARGV: tokens, owner, ttl_ms (0 = no
# expiry), the owner's session limit (0 = none), the session key prefix, the session id.
# 1 = created, 0 = id taken, -1 = the owner holds its limit. Without a limit no owner set is kept. Ids whose session
# expired are dropped from the owner's set before it is counted (at most `limit` lookups), so the count is of live
# sessions.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local limit = tonumber(ARGV[4])
if limit > 0 then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    if redis.call('EXISTS', ARGV[5] .. id) == 0 then redis.call('SREM', KEYS[2], id) end
  end
  if redis.call('SCARD', KEYS[2]) >= limit then return -1 end
end
redis.call('HSET', KEYS[1], 'tokens', ARGV[1], 'version', 0, 'owner', ARGV[2])
if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
if limit > 0 then
  redis.call('SADD', KEYS[2], ARGV[6])
  if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
end
return 1
"""

# KEYS[1] session key; ARGV: expected_version, tokens to append, ttl_ms (0 = none), max token bytes.
# Replies {_MISSING} | {_CONFLICT, version} | {_TOO_LONG, tokens} | {_APPENDED, version, tokens, owner}.
# Redis has no HAPPEND, so the tokens field is rewritten whole: O(session length) per append, at most
# 4 MB at MAX_SESSION_TOKENS.
_APPEND = """
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return {0} end
if tonumber(version) ~= tonumber(ARGV[1]) then return {1, tonumber(version)} end
local old = redis.call('HGET', KEYS[1], 'tokens')
local length = #old + #ARGV[2]
if length > tonumber(ARGV[4]) then return {2, length / 4} end
local tokens = old .. ARGV[2]
redis.call('HSET', KEYS[1], 'tokens', tokens)
local new_version = redis.call('HINCRBY', KEYS[1], 'version', 1)
if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return {3, new_version, tokens, redis.call('HGET', KEYS[1], 'owner')}
"""
_MISSING, _CONFLICT, _TOO_LONG, _APPENDED = 0, 1, 2, 3


class RedisStore:
    """SessionStore on Redis. `ttl_s` (None: forever) counts from creation and from each append;
    `max_sessions_per_owner` (None: no limit) bounds the live sessions of one owner (API key), counted
    atomically in the create script."""

    def __init__(
        self,
        url: str,
        namespace: str = "cascade",
        ttl_s: int | None = 7 * 24 * 3600,
        socket_timeout_s: float = 2.0,
        max_sessions_per_owner: int | None = None,
    ) -> None:
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"namespace must match {_NAMESPACE_RE.pattern}, got {namespace!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s!r}")
        self._prefix = f"{namespace}:session:"
        self._owners = f"{namespace}:owner:"
        self._quota = check_quota(max_sessions_per_owner)
        self._ttl_ms = 0 if ttl_s is None else max(1, round(ttl_s * 1000))
        self.display_url = redact_url(url)
        # One immediate retry and no backoff: a pooled connection left stale by a server restart is
        # replaced at once, while a server that is really down fails in one timeout, not a backoff series.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._create = self._client.register_script(_CREATE)
        self._append = self._client.register_script(_APPEND)

    def create(self, token_ids: Sequence[int] = (), session_id: str | None = None, owner: str = "") -> SessionRecord:
        tokens = check_token_ids(token_ids)
        session_id = new_session_id() if session_id is None else session_id
        check_session_id(session_id)
        check_owner(owner)
        with self._unavailable():
            created = self._create(
                keys=[self._key(session_id), self._owners + (owner or "-")],
                args=[_pack(tokens), owner.encode(), self._ttl_ms, self._quota or 0, self._prefix, session_id],
            )
        if created == -1:
            raise SessionQuotaExceeded(self._quota or 0)
        if not created:
            raise SessionExists(f"session {session_id!r} already exists")
        return SessionRecord(session_id, tokens, 0, owner)

    def get(self, session_id: str) -> SessionRecord:
        check_session_id(session_id)
        with self._unavailable():
            tokens, version, owner = self._client.hmget(self._key(session_id), ["tokens", "version", "owner"])
        if version is None:
            raise SessionNotFound(session_id)
        # The client returns bytes (decode_responses is off).
        raw, who = cast(bytes, tokens or b""), cast(bytes, owner or b"")
        return SessionRecord(session_id, _unpack(raw), int(version), who.decode())

    def append(self, session_id: str, token_ids: Sequence[int], expected_version: int) -> SessionRecord:
        check_session_id(session_id)
        tokens = check_token_ids(token_ids)
        check_version(expected_version)
        with self._unavailable():
            reply = self._append(
                keys=[self._key(session_id)],
                args=[expected_version, _pack(tokens), self._ttl_ms, 4 * MAX_SESSION_TOKENS],
            )
        status = reply[0]
        if status == _MISSING:
            raise SessionNotFound(session_id)
        if status == _CONFLICT:
            raise SessionConflict(f"session {session_id!r} is at version {reply[1]}, not {expected_version}")
        if status == _TOO_LONG:
            raise too_long(session_id, reply[1])
        return SessionRecord(session_id, _unpack(reply[2]), int(reply[1]), (reply[3] or b"").decode())

    def delete(self, session_id: str) -> bool:
        check_session_id(session_id)
        with self._unavailable():
            return self._client.delete(self._key(session_id)) == 1

    def ping(self) -> None:
        with self._unavailable():
            self._client.ping()

    def close(self) -> None:
        """Close pooled connections (the store stays usable: the pool reconnects on demand)."""
        self._client.close()

    def _key(self, session_id: str) -> str:
        return self._prefix + session_id

    @contextmanager
    def _unavailable(self) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as exc:
            raise StoreUnavailable(
                f"session store at {self.display_url} unavailable: {type(exc).__name__}: {exc}"
            ) from exc


def redact_url(url: str) -> str:
    """`url` with its password (in the userinfo or a `?password=` query) masked, for messages and logs."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        netloc = f"{user}:***@{netloc.rpartition('@')[2]}"
    query = "&".join(
        "password=***" if field.partition("=")[0] == "password" else field for field in parts.query.split("&") if field
    )
    return parts._replace(netloc=netloc, query=query).geturl()


def _pack(tokens: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _unpack(data: bytes) -> tuple[int, ...]:
    if len(data) % 4:
        raise SessionError(f"corrupt session: {len(data)} token bytes is not a multiple of 4")
    return struct.unpack(f"<{len(data) // 4}I", data)
