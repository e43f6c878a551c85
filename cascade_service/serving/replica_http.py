"""The OpenAI-compatible HTTP API inside a coordinator replica, for Ray Serve's HTTP proxy.

On a cluster, clients reach the app through Ray Serve's proxies: gRPC calls the coordinator's methods
by name, HTTP goes to the ASGI app the coordinator serves as its ingress (`serve.ingress`), as Ray Serve
LLM serves its OpenAI router. That app is `api.openai_http`'s, over a `Frontend` whose backend is the
replica itself: each call's message, made from the HTTP body, is handed as it is to the coordinator's
`serve` / `serve_stream` and awaited on the replica's event loop, where its decodes are submitted (no
bytes and no thread in between). Admission (API keys, per-key limits, workers and queue) is the same
code the standalone server and the edge run, sized by `serving.admission`.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

from ..api.admission import Limits
from ..api.backend import Call, Reply
from ..api.frontend import Frontend
from ..api.openai_http import http_options
from ..rpc.auth import ApiKeys


class Coordinator(Protocol):
    def serve(
        self, method: str, request: Any, owner: str = "", cancelled: Callable[[], bool] | None = None
    ) -> Awaitable[Reply]: ...

    def serve_stream(
        self, method: str, request: Any, owner: str = "", cancelled: Callable[[], bool] | None = None
    ) -> AsyncGenerator[Reply, None]: ...


class ReplicaBackend:
    """A `Backend` that awaits the replica's own calls on its event loop. A call that ends (the client
    disconnected, the front end drains) stops its decode at the next round. HTTP calls carry no deadline."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    async def call(self, call: Call) -> Reply:
        return await self.coordinator.serve(call.method, call.request, call.owner, _gone(call))

    async def stream(self, call: Call) -> AsyncGenerator[Reply, None]:
        replies = self.coordinator.serve_stream(call.method, call.request, call.owner, _gone(call))
        try:
            async for reply in replies:
                yield reply
        finally:
            await replies.aclose()  # a consumer that left early: the decode stops at its next round

    def close(self) -> None:
        """Nothing of its own: the calls are the replica's."""


def _gone(call: Call) -> Callable[[], bool]:
    """Whether the call has ended, read by its decode in the engine loop's thread after each round."""
    gone = threading.Event()
    if not call.hooks.on_end(gone.set):
        gone.set()
    return gone.is_set


def replica_app(
    coordinator: Coordinator, model: str, tokenizer: Any, limits: Limits, api_keys: ApiKeys | None
) -> tuple[Any, Frontend]:
    """The ASGI app a coordinator replica serves, and its front end (whose `drain` a stop calls)."""
    frontend = Frontend(ReplicaBackend(coordinator), limits, api_keys, serving=True)
    return http_options(0, model, tokenizer).app(frontend), frontend
