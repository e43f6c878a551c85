"""Session stores. RedisStore lives in `cascade_service.sessions.redis_store` and is not re-exported
here, so importing this package never imports redis."""

from cascade_service.sessions.memory import MemoryStore
from cascade_service.sessions.store import (
    MAX_SESSION_TOKENS,
    SESSION_ID_PATTERN,
    SessionConflict,
    SessionError,
    SessionExists,
    SessionForbidden,
    SessionNotFound,
    SessionQuotaExceeded,
    SessionRecord,
    SessionStore,
    StoreUnavailable,
    check_access,
    check_session_id,
    new_session_id,
)

__all__ = [
    "MAX_SESSION_TOKENS",
    "SESSION_ID_PATTERN",
    "MemoryStore",
    "SessionConflict",
    "SessionError",
    "SessionExists",
    "SessionForbidden",
    "SessionNotFound",
    "SessionQuotaExceeded",
    "SessionRecord",
    "SessionStore",
    "StoreUnavailable",
    "check_access",
    "check_session_id",
    "new_session_id",
]
