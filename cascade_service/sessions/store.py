"""Session stores: the contract every backend keeps (stdlib only, so importing it never imports redis).

A session is a conversation's token prefix. The server appends each request's prompt and output tokens
to it, and a later request continues from it. Appends are optimistic: the caller passes the version it
read, and the store refuses the append if another request got there first, so two requests racing on
one session can never interleave their tokens.
"""

from __future__ import annotations

import hmac
import operator
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..core.limits import is_integer
from ..core.quote import quoted

SESSION_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
MAX_SESSION_TOKENS = 1_000_000
# Token ids travel as uint32 in the Redis store; 2**31 also keeps them valid int32 tensor indices.
TOKEN_ID_LIMIT = 2**31

_SESSION_ID_RE = re.compile(SESSION_ID_PATTERN)


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    token_ids: tuple[int, ...]
    version: int  # 0 at creation, +1 per successful append
    owner: str = ""  # opaque id of the API key that created it ("" = anonymous)


class SessionError(Exception):
    """Base of every session-store error."""


class SessionNotFound(SessionError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} not found")
        self.session_id = session_id

    def __reduce__(self) -> tuple[type, tuple[str]]:
        # Rebuilt from the id, not from args (the formatted message), when it crosses processes.
        return SessionNotFound, (self.session_id,)


class SessionExists(SessionError):
    """create() with an id already in use."""


class SessionConflict(SessionError):
    """append() whose expected_version is stale: someone else appended first; re-read and retry."""


class SessionQuotaExceeded(SessionError):
    """create() by an owner that already holds its limit of sessions (`max_sessions_per_owner`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"this API key holds {limit} sessions, its limit; delete one or wait for one to expire")
        self.limit = limit

    def __reduce__(self) -> tuple[type, tuple[int]]:
        return SessionQuotaExceeded, (self.limit,)


def check_quota(limit: int | None) -> int | None:
    if limit is not None and (not is_integer(limit) or limit < 1):
        raise ValueError(f"max_sessions_per_owner must be an int >= 1 or None, got {quoted(limit)}")
    return limit


class StoreUnavailable(SessionError):
    """The backend is down or unreachable (connection refused, timeout, ...)."""


class SessionForbidden(SessionError):
    """The session belongs to another caller (another API key, or anonymous vs. a key)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} belongs to another API key")
        self.session_id = session_id


def check_access(record: SessionRecord, owner: str) -> SessionRecord:
    """`record` if `owner` (the caller's owner id, "" when anonymous) owns it; SessionForbidden otherwise.

    Sessions are their creator's: one created without a key (owner "") stays open to every anonymous
    caller, which is every caller of a server without keys; one created with a key only to that key.
    """
    if not hmac.compare_digest(record.owner.encode(), owner.encode()):
        raise SessionForbidden(record.session_id)
    return record


def check_session_id(session_id: str) -> None:
    # fullmatch, not match: `$` would accept a trailing newline.
    if not isinstance(session_id, str) or not _SESSION_ID_RE.fullmatch(session_id):
        raise ValueError(f"session_id must match {SESSION_ID_PATTERN}, got {quoted(session_id)}")


def new_session_id() -> str:
    # token_urlsafe may start with '-' or '_', which the pattern forbids first; the prefix fixes that.
    return "s-" + secrets.token_urlsafe(18)  # 144 random bits


def check_token_ids(token_ids: Sequence[int]) -> tuple[int, ...]:
    """The ids as a tuple of plain ints; ValueError unless each is an integer in [0, 2**31)."""
    if isinstance(token_ids, (str, bytes)):
        raise ValueError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    checked = []
    for token in token_ids:
        # bool is an int subclass, but True as a token id is always a caller bug.
        if isinstance(token, bool):
            raise ValueError(f"token ids must be ints, got {quoted(token)}")
        try:
            value = operator.index(token)  # accepts numpy / torch integer scalars, refuses floats
        except TypeError:
            raise ValueError(f"token ids must be ints, got {quoted(token)}") from None
        if not 0 <= value < TOKEN_ID_LIMIT:
            raise ValueError(f"token ids must be in [0, 2**31), got {value}")
        checked.append(value)
    if len(checked) > MAX_SESSION_TOKENS:
        raise ValueError(f"a session holds at most {MAX_SESSION_TOKENS} tokens, got {len(checked)}")
    return tuple(checked)


def check_version(expected_version: int) -> int:
    if not is_integer(expected_version) or expected_version < 0:
        raise ValueError(f"expected_version must be an int >= 0, got {quoted(expected_version)}")
    return expected_version


def check_owner(owner: str) -> str:
    if not isinstance(owner, str):
        raise ValueError(f"owner must be a str, got {type(owner).__name__}")
    return owner


def too_long(session_id: str, length: int) -> ValueError:
    return ValueError(f"session {session_id!r} would hold {length} tokens; the limit is {MAX_SESSION_TOKENS}")


class SessionStore(Protocol):
    """Where sessions live. Every method may raise StoreUnavailable when the backend is down."""

    def create(self, token_ids: Sequence[int] = (), session_id: str | None = None, owner: str = "") -> SessionRecord:
        """A new session at version 0 (a fresh id when none is given); SessionExists if the id is taken."""
        ...

    def get(self, session_id: str) -> SessionRecord:
        """The stored session; SessionNotFound if it is missing or expired."""
        ...

    def append(self, session_id: str, token_ids: Sequence[int], expected_version: int) -> SessionRecord:
        """Atomically extend the session, only if its version is still `expected_version`.

        SessionConflict if it is not (nothing changes); SessionNotFound if missing; ValueError if the
        result would exceed MAX_SESSION_TOKENS. Refreshes the session's TTL where the store has one.
        """
        ...

    def delete(self, session_id: str) -> bool:
        """Remove the session; True if it existed."""
        ...

    def ping(self) -> None:
        """Return if the backend answers; StoreUnavailable otherwise."""
        ...
