"""A fake CascadeService on 127.0.0.1 for the client SDK's tests, sync (SyncServer) and async (run_async),
and what those tests check every exception against."""

from __future__ import annotations

import asyncio
import socket
import time
from concurrent import futures

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cascade_service.api.status import DETAILS_KEY, set_status
from cascade_service.client import errors
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc as pb_grpc

API_KEY = "sekret"
OPTIONAL_FIELDS = ("max_new_tokens", "temperature", "top_p", "seed", "verification")

# ---- the fake service ----------------------------------------------------------------------------
# The prompt (or session id) steers the fake: "fail:CODE" aborts with CODE before replying,
# "rich:CODE" does too, with a message naming max_new_tokens and the rich details trailer the real
# server sends (api/status.py), "midstream:CODE" streams one chunk then aborts, "sleep:S" sleeps S
# seconds then echoes.


def echo_stats() -> pb.GenerateStats:
    return pb.GenerateStats(
        generated_tokens=3,
        target_calls=2,
        tiers={"target": pb.TierStats(calls=2, tokens_processed=9, time_s=0.25)},
        accepted_by_position=[2, 1],
        drafted_by_position=[2, 2],
        mean_accepted_length=1.5,
        wall_s=0.5,
    )


def echo_response(request: pb.GenerateRequest) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        text="echo:" + request.prompt,
        token_ids=[7, 8, 9],
        finish_reason="length",
        stats=echo_stats(),
        session_id=request.session_id,
        session_length=len(request.prompt_token_ids) + 3,
    )


def echo_chunks(request: pb.GenerateRequest) -> list[pb.GenerateChunk]:
    last = pb.GenerateChunk(text="c", token_ids=[9], finish_reason="length", stats=echo_stats(), session_length=3)
    return [pb.GenerateChunk(text="a", token_ids=[7]), pb.GenerateChunk(text="b", token_ids=[8]), last]


class FakeState:
    """What the fake saw and how it misbehaves; shared by the sync and the async servicer."""

    def __init__(self, api_key: str | None = None, get_session_failures: int = 0, retry_after_s: float | None = None):
        self.api_key = api_key  # when set, calls without `authorization: Bearer <key>` are refused
        self.get_session_failures = get_session_failures  # GetSession answers UNAVAILABLE this many times first
        self.retry_after_s = retry_after_s  # when set, those UNAVAILABLEs carry a RetryInfo with this delay
        self.requests: list = []  # every request, in arrival order
        self.metadata: list[dict[str, str]] = []  # each call's invocation metadata
        self.calls: dict[str, int] = {}
        self.sessions: dict[str, pb.Session] = {}

    def enter(self, method: str, request, context, steer: str) -> tuple[grpc.StatusCode | None, str, float]:
        """Records the call; returns (code to abort with or None, details, seconds to sleep first)."""
        self.calls[method] = self.calls.get(method, 0) + 1
        self.requests.append(request)
        metadata = dict(context.invocation_metadata())
        self.metadata.append(metadata)
        if self.api_key and metadata.get("authorization") != f"Bearer {self.api_key}":
            return grpc.StatusCode.UNAUTHENTICATED, "bad api key", 0.0
        if method == "GetSession" and self.get_session_failures > 0:
            self.get_session_failures -= 1
            if self.retry_after_s is not None:
                context.set_trailing_metadata(((DETAILS_KEY, retry_info_status(self.retry_after_s)),))
            return grpc.StatusCode.UNAVAILABLE, "warming up", 0.0
        kind, _, arg = steer.partition(":")
        if kind == "fail":
            return grpc.StatusCode[arg], f"asked to fail with {arg}", 0.0
        if kind == "rich":
            details = f"max_new_tokens: asked to fail with {arg}"
            set_status(context, grpc.StatusCode[arg], details)  # the trailer; the abort that follows keeps it
            return grpc.StatusCode[arg], details, 0.0
        return None, "", float(arg) if kind == "sleep" else 0.0

    def create(self, request: pb.CreateSessionRequest) -> pb.Session | tuple[grpc.StatusCode, str]:
        session_id = request.session_id or f"s-{len(self.sessions) + 1}"
        if session_id in self.sessions:
            return grpc.StatusCode.ALREADY_EXISTS, session_id
        tokens = list(request.prompt_token_ids) or [ord(c) for c in request.prompt]
        session = pb.Session(session_id=session_id, token_ids=tokens, version=1, text=request.prompt)
        self.sessions[session_id] = session
        return session

    def get(self, session_id: str) -> pb.Session | tuple[grpc.StatusCode, str]:
        return self.sessions.get(session_id) or (grpc.StatusCode.NOT_FOUND, session_id)


def retry_info_status(delay_s: float) -> bytes:
    """A serialized google.rpc.Status for UNAVAILABLE whose RetryInfo asks for `delay_s`."""
    retry = error_details_pb2.RetryInfo()
    retry.retry_delay.FromNanoseconds(int(delay_s * 1e9))
    detail = any_pb2.Any()
    detail.Pack(retry)
    return status_pb2.Status(
        code=grpc.StatusCode.UNAVAILABLE.value[0], message="warming up", details=[detail]
    ).SerializeToString()


def midstream_code(request: pb.GenerateRequest) -> grpc.StatusCode | None:
    kind, _, arg = request.prompt.partition(":")
    return grpc.StatusCode[arg] if kind == "midstream" else None


class SyncFake(pb_grpc.CascadeServiceServicer):
    def __init__(self, state: FakeState):
        self.state = state

    def _enter(self, method, request, context, steer=""):
        code, details, sleep_s = self.state.enter(method, request, context, steer)
        if code is not None:
            context.abort(code, details)
        time.sleep(sleep_s)

    def Generate(self, request, context):
        self._enter("Generate", request, context, request.prompt)
        return echo_response(request)

    def GenerateStream(self, request, context):
        self._enter("GenerateStream", request, context, request.prompt)
        for i, chunk in enumerate(echo_chunks(request)):
            if i == 1 and midstream_code(request):
                context.abort(midstream_code(request), "failed mid-stream")
            yield chunk

    def CreateSession(self, request, context):
        self._enter("CreateSession", request, context, request.session_id)
        reply = self.state.create(request)
        return reply if isinstance(reply, pb.Session) else context.abort(*reply)

    def GetSession(self, request, context):
        self._enter("GetSession", request, context, request.session_id)
        reply = self.state.get(request.session_id)
        return reply if isinstance(reply, pb.Session) else context.abort(*reply)

    def DeleteSession(self, request, context):
        self._enter("DeleteSession", request, context, request.session_id)
        return pb.DeleteSessionResponse(deleted=self.state.sessions.pop(request.session_id, None) is not None)


class AsyncFake(pb_grpc.CascadeServiceServicer):
    def __init__(self, state: FakeState):
        self.state = state

    async def _enter(self, method, request, context, steer=""):
        code, details, sleep_s = self.state.enter(method, request, context, steer)
        if code is not None:
            await context.abort(code, details)
        await asyncio.sleep(sleep_s)

    async def Generate(self, request, context):
        await self._enter("Generate", request, context, request.prompt)
        return echo_response(request)

    async def GenerateStream(self, request, context):
        await self._enter("GenerateStream", request, context, request.prompt)
        for i, chunk in enumerate(echo_chunks(request)):
            if i == 1 and midstream_code(request):
                await context.abort(midstream_code(request), "failed mid-stream")
            yield chunk

    async def CreateSession(self, request, context):
        await self._enter("CreateSession", request, context, request.session_id)
        reply = self.state.create(request)
        return reply if isinstance(reply, pb.Session) else await context.abort(*reply)

    async def GetSession(self, request, context):
        await self._enter("GetSession", request, context, request.session_id)
        reply = self.state.get(request.session_id)
        return reply if isinstance(reply, pb.Session) else await context.abort(*reply)

    async def DeleteSession(self, request, context):
        await self._enter("DeleteSession", request, context, request.session_id)
        return pb.DeleteSessionResponse(deleted=self.state.sessions.pop(request.session_id, None) is not None)


# ---- servers -------------------------------------------------------------------------------------


class SyncServer:
    def __init__(self, state: FakeState, health_status=health_pb2.HealthCheckResponse.SERVING):
        self.state = state
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_CascadeServiceServicer_to_server(SyncFake(state), self.server)
        self.health = health.HealthServicer()
        self.health.set("", health_status)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


def run_async(scenario, **state_kwargs) -> FakeState:
    """Runs `await scenario(target, state)` against a fresh grpc.aio fake server; returns the fake's state."""
    state = FakeState(**state_kwargs)

    async def main():
        aio_server = grpc.aio.server()
        pb_grpc.add_CascadeServiceServicer_to_server(AsyncFake(state), aio_server)
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, aio_server)
        port = aio_server.add_insecure_port("127.0.0.1:0")
        await aio_server.start()
        try:
            await scenario(f"127.0.0.1:{port}", state)
        finally:
            await aio_server.stop(None)

    asyncio.run(main())
    return state


def closed_port_target() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


STATUS_CASES = [
    ("INVALID_ARGUMENT", errors.InvalidArgument),
    ("NOT_FOUND", errors.NotFound),
    ("ALREADY_EXISTS", errors.AlreadyExists),
    ("FAILED_PRECONDITION", errors.FailedPrecondition),
    ("UNAVAILABLE", errors.Unavailable),
    ("DEADLINE_EXCEEDED", errors.DeadlineExceeded),
    ("RESOURCE_EXHAUSTED", errors.ResourceExhausted),
    ("UNAUTHENTICATED", errors.Unauthenticated),
    ("PERMISSION_DENIED", errors.PermissionDenied),
    ("CANCELLED", errors.Cancelled),
    ("INTERNAL", errors.Internal),
    ("DATA_LOSS", errors.CascadeError),  # no subclass: the base class, code kept
]


def assert_maps(exc: Exception, code_name: str, cls: type) -> None:
    assert type(exc) is cls and not isinstance(exc, grpc.RpcError)
    assert exc.code == grpc.StatusCode[code_name]
