"""The client SDK against a fake CascadeService on 127.0.0.1: every method, optional fields left unset,
status codes -> exception classes, deadlines, api key metadata, and retries. The fake (tests/helpers/fake_service.py)
serves both the sync client (here) and the async one (test_client_async.py)."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from cascade_service.api.status import RETRY_DELAY_S
from cascade_service.client import CascadeClient, Chunk, GenerateResult, SessionInfo, errors
from cascade_service.proto.v1 import cascade_pb2 as pb

from ..helpers.fake_service import (
    API_KEY,
    OPTIONAL_FIELDS,
    STATUS_CASES,
    FakeState,
    SyncServer,
    assert_maps,
    closed_port_target,
)


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


def test_a_keyword_the_call_does_not_take_is_a_type_error_before_anything_is_sent(server):
    # The fields are declared once (client.request): generate() takes n and best_of, stream() does not.
    with CascadeClient(server.target) as client:
        sent = len(server.state.requests)
        with pytest.raises(TypeError, match="^generate\\(\\) got an unexpected keyword argument 'temprature'$"):
            client.generate("x", temprature=0.0)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="^stream\\(\\) got an unexpected keyword argument 'n'$"):
            client.stream("x", n=2)  # type: ignore[call-arg]
    assert len(server.state.requests) == sent


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
        for call in (
            lambda: client.generate("rich:INVALID_ARGUMENT"),
            lambda: list(client.stream("rich:INVALID_ARGUMENT")),
        ):
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
