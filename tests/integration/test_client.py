"""The client SDK against a fake CascadeService on 127.0.0.1: every method, optional fields left unset,
status codes -> exception classes, deadlines, api key metadata, and retries. The fake serves both the
sync client (here) and the async one (test_client_async.py)."""

from __future__ import annotations

import asyncio
import socket
import time
from concurrent import futures

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cascade_service.api.status import DETAILS_KEY, RETRY_DELAY_S, set_status
from cascade_service.api.v1 import cascade_pb2 as pb
from cascade_service.api.v1 import cascade_pb2_grpc as pb_grpc
from cascade_service.client import CascadeClient, Chunk, GenerateResult, SessionInfo, errors

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
    return status_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0], message="warming up",
                             details=[detail]).SerializeToString()


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


@pytest.fixture
def make_server():
    servers: list[SyncServer] = []

    def make(**state_kwargs) -> SyncServer:
        servers.append(SyncServer(FakeState(**state_kwargs)))
        return servers[-1]

    yield make
    for s in servers:
        s.server.stop(None)


@pytest.fixture
def server(make_server) -> SyncServer:
    return make_server()


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


# ---- sync client ---------------------------------------------------------------------------------


def test_generate_returns_the_response_as_a_result_with_stats_as_a_plain_dict(server):
    with CascadeClient(server.target) as client:
        result = client.generate("def f():", session_id="s-9", prompt_token_ids=[1, 2])
    assert isinstance(result, GenerateResult)
    assert (result.text, result.token_ids, result.finish_reason) == ("echo:def f():", [7, 8, 9], "length")
    assert (result.session_id, result.session_length) == ("s-9", 5)
    assert result.stats["generated_tokens"] == 3 and result.stats["accepted_by_position"] == [2, 1]
    assert result.stats["tiers"]["target"] == {"calls": 2, "tokens_processed": 9, "time_s": 0.25}
    assert result.stats["mean_accepted_length"] == 1.5


def test_unset_optional_arguments_leave_proto3_optional_fields_unset(server):
    with CascadeClient(server.target) as client:
        client.generate("x", alpha=0.5)  # alpha without a verification rule is not sent
    request = server.state.requests[-1]
    assert [f for f in OPTIONAL_FIELDS if request.HasField(f)] == []
    assert (request.prompt, list(request.stop), request.session_id) == ("x", [], "")


def test_given_optional_arguments_are_sent_even_when_zero(server):
    with CascadeClient(server.target) as client:
        client.generate(
            prompt_token_ids=[5, 6], max_new_tokens=0, temperature=0.0, top_p=0.5, seed=2**40,
            stop="\n\n", verification="typical", alpha=0.25,
        )  # fmt: skip
    request = server.state.requests[-1]
    assert all(request.HasField(f) for f in OPTIONAL_FIELDS)
    assert (request.max_new_tokens, request.temperature, request.top_p, request.seed) == (0, 0.0, 0.5, 2**40)
    assert list(request.stop) == ["\n\n"]  # one stop string, not split into characters
    assert (request.verification.rule, request.verification.alpha) == ("typical", 0.25)
    assert (request.prompt, list(request.prompt_token_ids)) == ("", [5, 6])


def test_stream_yields_three_chunks_and_only_the_last_carries_finish_reason_and_stats(server):
    with CascadeClient(server.target) as client:
        chunks = list(client.stream("hi", max_new_tokens=3))
    assert all(isinstance(c, Chunk) for c in chunks)
    assert [c.text for c in chunks] == ["a", "b", "c"] and [c.token_ids for c in chunks] == [[7], [8], [9]]
    assert [c.finish_reason for c in chunks] == ["", "", "length"]
    assert chunks[0].stats is None and chunks[1].stats is None and chunks[2].stats["target_calls"] == 2
    assert chunks[2].session_length == 3
    assert server.state.requests[-1].max_new_tokens == 3


def test_leaving_a_stream_early_cancels_it_quietly(server):
    with CascadeClient(server.target) as client:
        chunks = client.stream("hi")
        assert next(chunks).text == "a"
        chunks.close()  # runs the generator's cleanup: the call is cancelled, nothing is raised
        assert client.generate("after").text == "echo:after"  # the channel is still usable


def test_sessions_create_get_delete(server):
    with CascadeClient(server.target) as client:
        created = client.create_session(prompt="ab", session_id="s-a")
        assert created == SessionInfo(session_id="s-a", token_ids=[97, 98], version=1, text="ab")
        assert client.create_session(prompt_token_ids=[4, 5]).token_ids == [4, 5]
        assert client.get_session("s-a") == created
        assert client.delete_session("s-a") is True
        assert client.delete_session("s-a") is False
        with pytest.raises(errors.NotFound):
            client.get_session("s-a")
        with pytest.raises(errors.AlreadyExists):
            client.create_session(session_id="s-2")  # the server named the token-id session s-2


def test_health_reports_serving_and_not_serving(server):
    with CascadeClient(server.target) as client:
        assert client.health() == "SERVING"
        server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert client.health() == "NOT_SERVING"


@pytest.mark.parametrize("code_name,cls", STATUS_CASES)
def test_each_status_code_raises_its_exception_class(server, code_name, cls):
    with CascadeClient(server.target) as client, pytest.raises(errors.CascadeError) as info:
        client.generate(f"fail:{code_name}")
    assert_maps(info.value, code_name, cls)
    assert info.value.details == f"asked to fail with {code_name}"


def test_deadline_from_the_constructor_or_the_call_raises_deadline_exceeded(server):
    with CascadeClient(server.target, timeout_s=0.05) as client:
        with pytest.raises(errors.DeadlineExceeded):
            client.generate("sleep:0.5")
        with pytest.raises(errors.DeadlineExceeded):
            list(client.stream("sleep:0.5"))
        assert client.generate("sleep:0.2", timeout_s=5.0).text == "echo:sleep:0.2"  # the call's value wins
    with CascadeClient(server.target) as client, pytest.raises(errors.DeadlineExceeded):
        client.create_session(session_id="sleep:0.5", timeout_s=0.05)


def test_errors_are_mapped_before_the_first_chunk_and_mid_stream(server):
    with CascadeClient(server.target) as client:
        with pytest.raises(errors.NotFound):
            next(iter(client.stream("fail:NOT_FOUND")))
        seen = []
        with pytest.raises(errors.CascadeError) as info:
            for chunk in client.stream("midstream:INTERNAL"):
                seen.append(chunk.text)
    assert seen == ["a"]
    assert_maps(info.value, "INTERNAL", errors.Internal)


def test_api_key_is_sent_as_bearer_metadata_on_every_call(make_server):
    server = make_server(api_key=API_KEY)
    with CascadeClient(server.target, api_key=API_KEY) as client:
        client.generate("x")
        list(client.stream("x"))
        client.create_session(session_id="k")
        client.get_session("k")
        client.delete_session("k")
    assert [m["authorization"] for m in server.state.metadata] == [f"Bearer {API_KEY}"] * 5
    with CascadeClient(server.target) as client, pytest.raises(errors.Unauthenticated):
        client.generate("x")
    assert "authorization" not in server.state.metadata[-1]


def test_get_session_retries_unavailable_and_succeeds_on_the_third_try(make_server):
    server = make_server(get_session_failures=2)
    server.state.sessions["s"] = pb.Session(session_id="s", version=4)
    with CascadeClient(server.target) as client:
        assert client.get_session("s").version == 4
    assert server.state.calls["GetSession"] == 3


def test_get_session_waits_as_long_as_the_servers_retry_info_says(make_server):
    server = make_server(get_session_failures=2, retry_after_s=0.3)
    server.state.sessions["s"] = pb.Session(session_id="s", version=4)
    with CascadeClient(server.target) as client:
        start = time.monotonic()
        assert client.get_session("s").version == 4
    # Two sleeps of the hinted 0.3 s; the default sleeps add up to 0.25 s.
    assert time.monotonic() - start >= 0.6 and server.state.calls["GetSession"] == 3


def test_a_retry_info_delay_is_bounded_by_the_calls_timeout(make_server):
    server = make_server(get_session_failures=2, retry_after_s=30.0)
    server.state.sessions["s"] = pb.Session(session_id="s", version=4)
    with CascadeClient(server.target, timeout_s=0.3) as client:
        start = time.monotonic()
        assert client.get_session("s").version == 4
    assert 0.6 <= time.monotonic() - start < 5.0


def test_the_rich_details_reach_the_exception(server):
    with CascadeClient(server.target) as client:
        for call in (lambda: client.generate("rich:INVALID_ARGUMENT"), lambda: list(client.stream("rich:INVALID_ARGUMENT"))):
            with pytest.raises(errors.InvalidArgument) as info:
                call()
            message = "max_new_tokens: asked to fail with INVALID_ARGUMENT"
            assert info.value.field_violations == (errors.FieldViolation("max_new_tokens", message),)
            assert info.value.retry_delay_s is None
        with pytest.raises(errors.ResourceExhausted) as info:
            client.generate("rich:RESOURCE_EXHAUSTED")
        assert info.value.retry_delay_s == RETRY_DELAY_S[grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert info.value.field_violations == ()
        with pytest.raises(errors.Internal) as info:
            client.generate("fail:INTERNAL")  # no trailer at all
        assert (info.value.field_violations, info.value.retry_delay_s) == ((), None)


def test_get_session_gives_up_after_three_tries(make_server):
    server = make_server(get_session_failures=5)
    with CascadeClient(server.target) as client, pytest.raises(errors.Unavailable):
        client.get_session("s")
    assert server.state.calls["GetSession"] == 3


def test_generate_stream_create_and_delete_are_never_retried(server):
    with CascadeClient(server.target) as client:
        with pytest.raises(errors.Unavailable):
            client.generate("fail:UNAVAILABLE")
        with pytest.raises(errors.Unavailable):
            list(client.stream("fail:UNAVAILABLE"))
        with pytest.raises(errors.Unavailable):
            client.create_session(session_id="fail:UNAVAILABLE")
        with pytest.raises(errors.Unavailable):
            client.delete_session("fail:UNAVAILABLE")
    assert server.state.calls == {"Generate": 1, "GenerateStream": 1, "CreateSession": 1, "DeleteSession": 1}


def test_unreachable_server_raises_unavailable_not_a_grpc_error():
    with CascadeClient(closed_port_target(), timeout_s=5.0) as client:
        with pytest.raises(errors.Unavailable):
            client.health()  # retried, then mapped
        with pytest.raises(errors.Unavailable):
            client.generate("x")


def test_root_certificates_without_tls_is_refused():
    with pytest.raises(ValueError, match="tls"):
        CascadeClient("127.0.0.1:1", root_certificates=b"pem")


def test_tls_client_builds_a_secure_channel_and_maps_its_failures():
    # No TLS server here: this checks the secure channel is built and a failed connect is mapped.
    with CascadeClient(closed_port_target(), tls=True, timeout_s=2.0) as client, pytest.raises(errors.Unavailable):
        client.generate("x")
