"""AsyncCascadeClient: the asyncio twin of sync.CascadeClient (grpc.aio), same arguments and results."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cascade_service.client import errors
from cascade_service.client.request import GenerateOptions, StreamOptions, generate_request
from cascade_service.client.sync import (
    CHANNEL_OPTIONS,
    RETRY_DELAYS_S,
    Chunk,
    GenerateResult,
    SessionInfo,
    call_metadata,
    channel_credentials,
    chunk_from,
    create_session_request,
    is_retryable,
    result_from,
    retry_delay_s,
    session_from,
)
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc as pb_grpc


class AsyncCascadeClient:
    """Asyncio client for one cascade-service endpoint ("host:port"). Every method raises
    errors.CascadeError subclasses, never raw grpc errors. Use `async with` or `await close()`."""

    def __init__(
        self,
        target: str,
        timeout_s: float | None = 60.0,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
    ):
        credentials = channel_credentials(tls, root_certificates)
        self._channel = (
            grpc.aio.secure_channel(target, credentials, CHANNEL_OPTIONS)
            if credentials
            else grpc.aio.insecure_channel(target, CHANNEL_OPTIONS)
        )
        self._stub = pb_grpc.CascadeServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._timeout_s = timeout_s
        self._metadata = call_metadata(api_key)

    async def generate(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        """Decode to the end; `options` are the request's fields (client.request.GenerateOptions), each a
        keyword. With session_id, continue that session and append prompt + output to it. With n (or
        best_of) above 1, `choices` holds n independent choices (seed + i each)."""
        request = generate_request(prompt, options)
        return result_from(await self._call(self._stub.Generate, request, timeout_s))

    def stream(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **options: Unpack[StreamOptions]
    ) -> AsyncIterator[Chunk]:
        """The same decode as generate(), yielding chunks as the target commits tokens (`async for`);
        the last chunk carries finish_reason and stats. Leaving the loop early cancels the call."""
        return self._chunks(generate_request(prompt, options, StreamOptions, "stream"), timeout_s)

    async def _chunks(self, request: pb.GenerateRequest, timeout_s: float | None) -> AsyncIterator[Chunk]:
        call = self._stub.GenerateStream(request, timeout=self._deadline(timeout_s), metadata=self._metadata)
        try:
            async for chunk in call:
                yield chunk_from(chunk)
        except grpc.RpcError as e:  # raised at any point of the stream, the first chunk or mid-way
            raise errors.from_rpc_error(e) from e
        finally:
            call.cancel()  # a consumer that stops early frees the server's decode; no-op once finished

    async def create_session(
        self,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        session_id: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> SessionInfo:
        """A new session, optionally named and seeded with a prefix (text or token ids)."""
        request = create_session_request(prompt, prompt_token_ids, session_id)
        return session_from(await self._call(self._stub.CreateSession, request, timeout_s))

    async def get_session(self, session_id: str, *, timeout_s: float | None = None) -> SessionInfo:
        request = pb.GetSessionRequest(session_id=session_id)
        return session_from(await self._call(self._stub.GetSession, request, timeout_s, idempotent=True))

    async def delete_session(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """True if the session existed and was deleted."""
        request = pb.DeleteSessionRequest(session_id=session_id)
        return (await self._call(self._stub.DeleteSession, request, timeout_s)).deleted

    async def health(self, *, timeout_s: float | None = None) -> str:
        """The server's overall status from grpc.health.v1: "SERVING" or "NOT_SERVING"."""
        request = health_pb2.HealthCheckRequest(service="")
        response = await self._call(self._health.Check, request, timeout_s, idempotent=True)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncCascadeClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def _deadline(self, timeout_s: float | None) -> float | None:
        return self._timeout_s if timeout_s is None else timeout_s

    async def _call(self, rpc: Callable[..., Awaitable], request, timeout_s: float | None, *, idempotent=False):
        # Same policy as the sync client: only idempotent calls retry, only on UNAVAILABLE.
        delays = RETRY_DELAYS_S if idempotent else ()
        for attempt in range(len(delays) + 1):
            try:
                return await rpc(request, timeout=self._deadline(timeout_s), metadata=self._metadata)
            except grpc.RpcError as e:
                if attempt < len(delays) and is_retryable(e):
                    await asyncio.sleep(retry_delay_s(e, delays[attempt], self._deadline(timeout_s)))
                    continue
                raise errors.from_rpc_error(e) from e
