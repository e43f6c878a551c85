"""Client values quoted in error messages: short, escaped, never the whole value.

An error message travels back in gRPC's status (a header): a 64 KB session id quoted whole would
overflow the client's metadata limit, and the client would see RESOURCE_EXHAUSTED instead of the
error. So a message shows at most a short prefix of a value, escaped (repr), and its length.
"""

from __future__ import annotations

from typing import Any

MAX_QUOTED_CHARS = 40


def quoted(value: Any, limit: int = MAX_QUOTED_CHARS) -> str:
    """repr(value) when short; else the repr of its first `limit` characters and how long it is."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    text = repr(value)
    return text if len(text) <= 2 * limit else text[: 2 * limit] + "..."
