"""CascadeClient: the blocking Python SDK for cascade.v1.CascadeService (protos/cascade/v1/cascade.proto).

The result types, request builders and retry policy defined here are shared with aio.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Unpack

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cascade_service.client import errors
from cascade_service.client.request import GenerateOptions, StreamOptions, generate_request
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc as pb_grpc

# Sleeps between tries of an idempotent call (get_session, health) that failed with UNAVAILABLE:
# 3 tries in all. Other calls decode or mutate a session, so they are never retried automatically.
RETRY_DELAYS_S = (0.05, 0.2)
# A server that says how long to wait (google.rpc.RetryInfo on UNAVAILABLE; api/status.py) knows the
# cause, e.g. a restarting tier needs longer than a dropped connection, so its hint replaces the
# default sleep; bounded, so that a hint cannot stall the caller for long.
MAX_RETRY_DELAY_S = 5.0


@dataclass(frozen=True)
class GenerateResult:
    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: str  # "eos", "length" or "stop"
    stats: dict  # GenerateStats as a plain dict (proto field names)
    session_id: str  # echoed when the request named a session
    session_length: int  # tokens in the session after this request
    logprobs: list[dict] = field(default_factory=list)  # per token when asked: token_id, text, logprob, top
    # n or best_of above 1: each choice (its text, tokens, finish, stats, logprobs); the fields above empty
    choices: list[GenerateResult] = field(default_factory=list)


@dataclass(frozen=True)
class Chunk:
    text: str  # text added by this chunk
    token_ids: list[int]  # tokens added by this chunk
    finish_reason: str  # set on the last chunk only
    stats: dict | None  # set on the last chunk only
    session_length: int  # set on the last chunk of a session request
    logprobs: list[dict] = field(default_factory=list)  # per token of this chunk, when asked


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    token_ids: list[int]  # the stored prefix
    version: int  # bumped by every append
    text: str  # token_ids decoded


# ---- shared with aio.py: requests, responses, metadata, channel credentials ----


# A session of MAX_SESSION_TOKENS comes back whole from GetSession (ids and text): past gRPC's 4 MiB default.
MAX_REPLY_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
    ("grpc.max_send_message_length", MAX_REPLY_BYTES),
]


def create_session_request(
    prompt: str | None, prompt_token_ids: Sequence[int] | None, session_id: str | None
) -> pb.CreateSessionRequest:
    return pb.CreateSessionRequest(
        session_id=session_id or "", prompt=prompt or "", prompt_token_ids=list(prompt_token_ids or ())
    )


def stats_dict(stats: pb.GenerateStats) -> dict:
    # int64 counters come back as ints, not the JSON mapping's quoted strings.
    return json_format.MessageToDict(stats, preserving_proto_field_name=True, unquote_int64_if_possible=True)


def logprob_dict(t: pb.TokenLogprob) -> dict:
    return json_format.MessageToDict(t, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)


def result_from(response: pb.GenerateResponse) -> GenerateResult:
    return GenerateResult(
        text=response.text,
        token_ids=list(response.token_ids),
        finish_reason=response.finish_reason,
        stats=stats_dict(response.stats),
        session_id=response.session_id,
        session_length=response.session_length,
        logprobs=logprobs(response),
        choices=[
            GenerateResult(c.text, list(c.token_ids), c.finish_reason, stats_dict(c.stats), "", 0, logprobs(c))
            for c in response.choices
        ],
    )


def logprobs(reply: pb.GenerateResponse | pb.Choice) -> list[dict]:
    return [logprob_dict(t) for t in reply.logprobs]


def chunk_from(chunk: pb.GenerateChunk) -> Chunk:
    return Chunk(
        text=chunk.text,
        token_ids=list(chunk.token_ids),
        finish_reason=chunk.finish_reason,
        stats=stats_dict(chunk.stats) if chunk.HasField("stats") else None,
        session_length=chunk.session_length,
        logprobs=[logprob_dict(t) for t in chunk.logprobs],
    )


def session_from(session: pb.Session) -> SessionInfo:
    return SessionInfo(
        session_id=session.session_id, token_ids=list(session.token_ids), version=session.version, text=session.text
    )


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def channel_credentials(tls: bool, root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    """TLS credentials, or None for a plaintext channel."""
    if root_certificates is not None and not tls:
        raise ValueError("root_certificates given without tls=True")
    return grpc.ssl_channel_credentials(root_certificates) if tls else None


def is_retryable(e: grpc.RpcError) -> bool:
    return callable(getattr(e, "code", None)) and e.code() == grpc.StatusCode.UNAVAILABLE


def retry_delay_s(e: grpc.RpcError, default_s: float, timeout_s: float | None) -> float:
    """Seconds to sleep before retrying after `e`: the server's RetryInfo when it sent one, at most
    MAX_RETRY_DELAY_S and never longer than one try's own timeout; otherwise `default_s`."""
    _, hinted = errors.rich_details(e)
    if hinted is None:
        return default_s
    bound = MAX_RETRY_DELAY_S if timeout_s is None else min(MAX_RETRY_DELAY_S, timeout_s)
    return min(max(hinted, 0.0), bound)


# ---- the blocking client ----


class CascadeClient:
    """Blocking client for one cascade-service endpoint ("host:port"). Every method raises
    errors.CascadeError subclasses, never raw grpc errors. Use as a context manager or call close()."""

    def __init__(
        self,
        target: str,
        timeout_s: float | None = 60.0,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
    ):
        credentials = channel_credentials(tls, root_certificates)
        options = CHANNEL_OPTIONS
        self._channel = (
            grpc.secure_channel(target, credentials, options) if credentials else grpc.insecure_channel(target, options)
        )
        self._stub = pb_grpc.CascadeServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._timeout_s = timeout_s
        self._metadata = call_metadata(api_key)

    def generate(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        """Decode to the end; `options` are the request's fields (client.request.GenerateOptions), each a
        keyword. With session_id, continue that session and append prompt + output to it. With n (or
        best_of) above 1, `choices` holds n independent choices (seed + i each)."""
        request = generate_request(prompt, options)
        return result_from(self._call(self._stub.Generate, request, timeout_s))

    def stream(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **options: Unpack[StreamOptions]
    ) -> Iterator[Chunk]:
        """The same decode as generate(), yielding chunks as the target commits tokens; the last chunk
        carries finish_reason and stats. The call starts on the first next(); leaving early cancels it."""
        return self._chunks(generate_request(prompt, options, StreamOptions, "stream"), timeout_s)

    def _chunks(self, request: pb.GenerateRequest, timeout_s: float | None) -> Iterator[Chunk]:
        call = self._stub.GenerateStream(request, timeout=self._deadline(timeout_s), metadata=self._metadata)
        try:
            for chunk in call:
                yield chunk_from(chunk)
        except grpc.RpcError as e:  # raised at any point of the stream, the first chunk or mid-way
            raise errors.from_rpc_error(e) from e
        finally:
            call.cancel()  # a consumer that stops early frees the server's decode; no-op once finished

    def create_session(
        self,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        session_id: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> SessionInfo:
        """A new session, optionally named and seeded with a prefix (text or token ids)."""
        request = create_session_request(prompt, prompt_token_ids, session_id)
        return session_from(self._call(self._stub.CreateSession, request, timeout_s))

    def get_session(self, session_id: str, *, timeout_s: float | None = None) -> SessionInfo:
        request = pb.GetSessionRequest(session_id=session_id)
        return session_from(self._call(self._stub.GetSession, request, timeout_s, idempotent=True))

    def delete_session(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """True if the session existed and was deleted."""
        request = pb.DeleteSessionRequest(session_id=session_id)
        return self._call(self._stub.DeleteSession, request, timeout_s).deleted

    def health(self, *, timeout_s: float | None = None) -> str:
        """The server's overall status from grpc.health.v1: "SERVING" or "NOT_SERVING"."""
        request = health_pb2.HealthCheckRequest(service="")
        response = self._call(self._health.Check, request, timeout_s, idempotent=True)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CascadeClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _deadline(self, timeout_s: float | None) -> float | None:
        return self._timeout_s if timeout_s is None else timeout_s

    def _call(self, rpc: Callable, request, timeout_s: float | None, *, idempotent: bool = False):
        # Each try gets the full deadline: a retry follows a fast UNAVAILABLE, not a slow call.
        delays = RETRY_DELAYS_S if idempotent else ()
        for attempt in range(len(delays) + 1):
            try:
                return rpc(request, timeout=self._deadline(timeout_s), metadata=self._metadata)
            except grpc.RpcError as e:
                if attempt < len(delays) and is_retryable(e):
                    time.sleep(retry_delay_s(e, delays[attempt], self._deadline(timeout_s)))
                    continue
                raise errors.from_rpc_error(e) from e
