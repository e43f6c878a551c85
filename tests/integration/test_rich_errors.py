"""The rich error details where no model is needed: the edge (api/edge.py) in front of a fake
coordinator deployment, and the standalone server's own RESOURCE_EXHAUSTED and UNAVAILABLE.

The edge gets only a code name and a message from the deployment; what a client receives must be the
same trailer the coordinator would have sent itself (api/status.rich_status of that code and message,
byte for byte), on unary calls and on streams, before the first chunk or after one.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from cascade_service.api.edge import start_edge
from cascade_service.api.server import start_server
from cascade_service.api.servicer import Overloaded, Unavailable
from cascade_service.api.status import DETAILS_KEY, RETRY_DELAY_S, rich_status
from cascade_service.client import CascadeClient, errors
from cascade_service.engine.loop import TaskLoop
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc
from cascade_service.sessions import StoreUnavailable

BETA = "verification.beta: give beta or tune_beta, not both"
BUSY = "tier 'mid' is at its queue limit; retry later"
DOWN = "tier 'mid' unavailable (ActorDiedError); retry the request"
MISSING = "session_id: session 'gone' not found"
# prompt -> (code name, message) the fake deployment answers with
FAILURES = {
    "bad": ("INVALID_ARGUMENT", BETA),
    "busy": ("RESOURCE_EXHAUSTED", BUSY),
    "down": ("UNAVAILABLE", DOWN),
    "missing": ("NOT_FOUND", MISSING),
}


class FakeDeployment:
    """A `Backend` answering as the coordinator deployment does, (code name, details, body); the
    prompt says which failure. A stream sends one chunk first when the prompt ends in "-late"."""

    def call(self, call):
        code, details = FAILURES[call.request.prompt]
        return code, details, b""

    def stream(self, call) -> Iterator[tuple[str, str, bytes]]:
        prompt = call.request.prompt
        if prompt.endswith("-late"):
            yield "OK", "", pb.GenerateChunk(text="a", token_ids=[7]).SerializeToString()
        code, details = FAILURES[prompt.removesuffix("-late")]
        yield code, details, b""


@pytest.fixture(scope="module")
def edge():
    server, port, _ = start_edge(FakeDeployment(), workers=4)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield f"127.0.0.1:{port}", cascade_pb2_grpc.CascadeServiceStub(channel)
    server.stop(0)


def _failed(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        reply = call(request, timeout=30)
        if not isinstance(reply, pb.GenerateResponse):
            list(reply)
    return caught.value


def _trailer(error: grpc.RpcError) -> bytes:
    raw = [value for key, value in error.trailing_metadata() or () if key == DETAILS_KEY]
    assert len(raw) == 1, error.trailing_metadata()
    return raw[0]


@pytest.mark.parametrize("call", ["unary", "stream", "stream-late"])
@pytest.mark.parametrize("prompt", list(FAILURES))
def test_the_edge_sends_the_trailer_of_the_forwarded_code_and_message(edge, prompt, call):
    _, stub = edge
    code_name, message = FAILURES[prompt]
    rpc = stub.Generate if call == "unary" else stub.GenerateStream
    error = _failed(rpc, pb.GenerateRequest(prompt=prompt + ("-late" if call == "stream-late" else "")))
    code = grpc.StatusCode[code_name]
    assert (error.code(), error.details()) == (code, message)
    assert _trailer(error) == rich_status(code, message).SerializeToString()


def test_the_sdk_reads_what_the_edge_sends(edge):
    address, _ = edge
    with CascadeClient(address, timeout_s=30) as client:
        for call in (lambda: client.generate("bad"), lambda: list(client.stream("bad-late"))):
            with pytest.raises(errors.InvalidArgument) as caught:
                call()
            assert caught.value.field_violations == (errors.FieldViolation("verification.beta", BETA),)
        with pytest.raises(errors.ResourceExhausted) as busy:
            client.generate("busy")
        assert busy.value.retry_delay_s == RETRY_DELAY_S[grpc.StatusCode.RESOURCE_EXHAUSTED]
        with pytest.raises(errors.NotFound) as missing:
            client.generate("missing")
        assert (missing.value.field_violations, missing.value.retry_delay_s) == ((), None)


class FailingCoordinator:
    """Enough of a Coordinator for the session calls; each raises what a busy or broken one does."""

    loop = TaskLoop()  # where a served coordinator's calls run

    def create_session(self, session_id, prompt, prompt_token_ids, owner=""):
        raise Overloaded(BUSY)

    def get_session(self, session_id, owner=""):
        raise StoreUnavailable("session actor unavailable (ActorDiedError)")

    def delete_session(self, session_id, owner=""):
        raise Unavailable(DOWN)


def test_the_standalone_servers_own_busy_and_unavailable_carry_retry_info():
    server, port = start_server(FailingCoordinator())  # type: ignore[arg-type]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cascade_pb2_grpc.CascadeServiceStub(channel)
            for rpc, request, code in [
                (stub.CreateSession, pb.CreateSessionRequest(), grpc.StatusCode.RESOURCE_EXHAUSTED),
                (stub.GetSession, pb.GetSessionRequest(session_id="s"), grpc.StatusCode.UNAVAILABLE),
                (stub.DeleteSession, pb.DeleteSessionRequest(session_id="s"), grpc.StatusCode.UNAVAILABLE),
            ]:
                error = _failed(rpc, request)
                assert error.code() == code
                assert _trailer(error) == rich_status(code, error.details()).SerializeToString()
                status = status_pb2.Status.FromString(_trailer(error))
                retry = error_details_pb2.RetryInfo()
                assert [d.Unpack(retry) for d in status.details] == [True]
                assert retry.retry_delay.ToNanoseconds() == int(RETRY_DELAY_S[code] * 1e9)
        with (
            CascadeClient(f"127.0.0.1:{port}", timeout_s=30) as client,
            pytest.raises(errors.ResourceExhausted) as busy,
        ):
            client.create_session()
        assert (busy.value.details, busy.value.retry_delay_s) == (
            BUSY,
            RETRY_DELAY_S[grpc.StatusCode.RESOURCE_EXHAUSTED],
        )
    finally:
        server.stop(0)
