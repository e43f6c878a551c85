"""The embedded session store for the Ray wiring: a MemoryStore inside a detached, named Ray actor.

The actor outlives restarts of the Serve app (every tier and the coordinator) but not a restart of
Ray; `serving.redis_url` selects Redis instead, which outlives both.
"""

from __future__ import annotations

from typing import Any

import ray

from ..config import ServingConfig
from ..sessions import MemoryStore, SessionStore, StoreUnavailable

SESSION_ACTOR = "cascade-sessions"
RAY_NAMESPACE = "cascade-service"


@ray.remote
class SessionActor:
    """The embedded session store, kept in a detached actor so the coordinator can restart."""

    def __init__(self, ttl_s: float | None, max_sessions_per_owner: int | None = None):
        self.store = MemoryStore(ttl_s, max_sessions_per_owner)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.store, method)(*args)


class ActorStore:
    """SessionStore over SessionActor (errors re-raised as the store's own exception types)."""

    def __init__(self, actor: Any):
        self.actor = actor

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(self.actor.call.remote(method, *args), timeout=30)
        except ray.exceptions.RayTaskError as exc:
            # The store's own exception, not Ray's wrapper: the wrapper's text is the actor's traceback
            # (process ids, file paths, colour codes), which must never reach a client.
            if isinstance(exc.cause, Exception):
                raise exc.cause from None
            raise StoreUnavailable(f"session actor failed ({type(exc.cause).__name__})") from None
        except ray.exceptions.RayError as exc:
            raise StoreUnavailable(f"session actor unavailable ({type(exc).__name__})") from None

    def create(self, token_ids=(), session_id=None, owner=""):
        return self._call("create", list(token_ids), session_id, owner)

    def get(self, session_id):
        return self._call("get", session_id)

    def append(self, session_id, token_ids, expected_version):
        return self._call("append", session_id, list(token_ids), expected_version)

    def delete(self, session_id):
        return self._call("delete", session_id)

    def ping(self):
        return self._call("ping")


def actor_store(serving: ServingConfig) -> SessionStore:
    """The cluster's embedded store: one detached actor, created on first use (runtime.session_store
    picks Redis instead where the config names it)."""
    actor = SessionActor.options(  # type: ignore[attr-defined]  # ray.remote's wrapper, unseen by mypy
        name=SESSION_ACTOR, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0
    ).remote(serving.session_ttl_s, serving.max_sessions_per_key)
    return ActorStore(actor)
