"""One gRPC contract (and one OpenAI-compatible HTTP API) on every frontend, as a client in another
language sees it.

Each frontend runs as a real `cascade-service serve` process (standalone: one process, no Ray; edge:
our gRPC edge in front of the Ray Serve app; ray: Ray Serve's own gRPC proxy), and the same tests
talk to it with plain generated stubs over loopback, not the SDK, so that what is checked is what
goes over the wire: exact greedy output (the `transformers` oracle), stream == unary, sessions,
health Check and Watch, reflection v1 and v1alpha, the same status code AND the same one-line
message for every error on unary and streaming calls, the rich error details, deadlines, cancel,
nothing listening beyond loopback, and SIGTERM: the process drains and exits 0 within the config's
serving.shutdown_grace_s. Each also serves HTTP (`--http-port 0`; on "ray", Ray Serve's HTTP proxy to
the coordinator's ASGI app), checked with the real `openai` client: the same greedy text as gRPC.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
import openai
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from prometheus_client.parser import text_string_to_metric_families

from cascade_service import procfs
from cascade_service.api.admission import MAX_REQUEST_BYTES as MAX_MESSAGE_BYTES
from cascade_service.client import CascadeClient, errors
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.rpc import reflection
from cascade_service.zoo.tiny import random_prompts

from ..helpers.grpc_errors import BAD_REQUESTS  # checked here as every front end answers them
from ..helpers.oracle import oracle
from . import node_client
from .conftest import GRACE_S, TEARDOWN_BOUND_S
from .serve_process import left_behind, tree


def _error(call, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, pb.GenerateResponse):
            list(result)  # a stream fails while it is read
    return caught.value


def status_details(error: grpc.RpcError) -> status_pb2.Status:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    raise AssertionError(f"no grpc-status-details-bin in {error.trailing_metadata()}")


def test_greedy_output_is_the_oracles_and_a_stream_yields_the_same_tokens(served, tiny_family):
    for prompt in random_prompts(2, 9, seed=7):
        expected = oracle(tiny_family["target"], prompt, 12)
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=12, temperature=0)
        reply = served.stub.Generate(request, timeout=120)
        assert list(reply.token_ids) == expected
        assert reply.finish_reason == "length" and reply.stats.generated_tokens == 12
        chunks = list(served.stub.GenerateStream(request, timeout=120))
        assert [t for c in chunks for t in c.token_ids] == expected
        assert chunks[-1].finish_reason == "length" and chunks[-1].stats.generated_tokens == 12


def test_the_openai_client_gets_the_grpc_text_unary_and_streamed(served, tiny_family):
    client = openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=120)
    prompt = random_prompts(1, 9, seed=11)[0]
    direct = served.stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=12), timeout=120)
    assert list(direct.token_ids) == oracle(tiny_family["target"], prompt, 12)
    reply = client.completions.create(model="target", prompt=prompt, max_tokens=12, temperature=0)
    assert reply.choices[0].text == direct.text and reply.usage.completion_tokens == 12
    assert reply.model_extra["cascade"]["generated_tokens"] == 12
    chunks = list(client.completions.create(model="target", prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct.text
    both: dict[int, str] = {}  # n streamed: each choice's chunks under its index
    for chunk in client.completions.create(
        model="target", prompt=prompt, max_tokens=12, temperature=0, n=2, stream=True
    ):
        for choice in chunk.choices:
            both[choice.index] = both.get(choice.index, "") + choice.text
    assert both == {0: direct.text, 1: direct.text}
    plain = client.completions.create(  # speculation off for this request: the same text, a pass per token
        model="target", prompt=prompt, max_tokens=12, temperature=0, extra_body={"speculation": {"mode": "off"}}
    )
    assert plain.choices[0].text == direct.text and plain.model_extra["cascade"]["target_calls"] == 12
    top1 = client.completions.create(  # top_k 1 at temperature 1: the greedy text again
        model="target", prompt=prompt, max_tokens=12, temperature=1.0, seed=4, extra_body={"top_k": 1}
    )
    assert top1.choices[0].text == direct.text
    assert [m.id for m in client.models.list().data] == ["target"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="target", prompt=prompt, max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"
    # /metrics (beside /v1) counts the requests decoded: the standalone process's own; the edge's merged
    # with its coordinator's and tiers'; on "ray", the coordinator replica that answered.
    with urllib.request.urlopen(served.http_url.removesuffix("/v1") + "/metrics", timeout=30) as page:
        samples = {
            (s.name, s.labels.get("tier")): s.value
            for f in text_string_to_metric_families(page.read().decode())
            for s in f.samples
        }
    assert samples[("cascade:generation_tokens_total", None)] >= 3 * 12  # the requests above
    assert samples[("cascade:spec_decode_num_drafts_total", "target")] > 0
    assert samples[("cascade:heap_frozen_objects", None)] > 0  # its start-up heap left the collector's walks
    if served.frontend != "ray":
        assert samples[("cascade:tier_pass_seconds_count", "target")] > 0


def test_a_repeated_prompt_drafts_from_what_the_first_one_wrote(served, tiny_family):
    # Suffix decoding keeps each finished request (of the caller's key; here no keys: one space), so
    # the same prompt again is drafted from the first one's output: fewer target calls, same tokens.
    prompt = random_prompts(1, 14, seed=23)[0]
    expected = oracle(tiny_family["target"], prompt, 24)
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=24)
    first, again = (served.stub.Generate(request, timeout=120) for _ in range(2))
    assert list(first.token_ids) == list(again.token_ids) == expected
    assert again.stats.target_calls < first.stats.target_calls
    assert again.stats.tiers["suffix_lookup"].drafted > first.stats.tiers["suffix_lookup"].drafted
    # and through the OpenAI-compatible API, with another prompt
    client = openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=120)
    prompt = random_prompts(1, 14, seed=24)[0]
    replies = [client.completions.create(model="target", prompt=prompt, max_tokens=24, temperature=0) for _ in "ab"]
    assert replies[0].choices[0].text == replies[1].choices[0].text
    calls = [r.model_extra["cascade"]["target_calls"] for r in replies]
    assert calls[1] < calls[0], calls


def test_http_errors_are_openai_error_bodies(served):
    request = urllib.request.Request(
        served.http_url + "/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400
    assert json.loads(caught.value.read())["error"]["type"] == "invalid_request_error"


def test_health_check_and_watch(served):
    health = health_pb2_grpc.HealthStub(served.channel)
    for service in ("", "cascade.v1.CascadeService"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        watch = health.Watch(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    error = _error(health.Check, health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN  # the call stays open
    watch.cancel()


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_the_services_in_both_versions(served, version):
    # Each version's own message classes, as a client of that version has them.
    request, response = (
        (reflection.ServerReflectionRequest, reflection.ServerReflectionResponse)
        if version == "v1"
        else (reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse)
    )
    info = served.channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=request.SerializeToString,
        response_deserializer=response.FromString,
    )
    replies = list(
        info(
            iter(
                [
                    request(list_services=""),
                    request(file_containing_symbol="cascade.v1.CascadeService"),
                    request(file_containing_symbol=f"grpc.reflection.{version}.ServerReflection"),
                    request(file_containing_symbol="no.Such"),
                ]
            ),
            timeout=30,
        )
    )
    names = {s.name for s in replies[0].list_services_response.service}
    # Exactly these: on Ray's proxy, not its own RayServeAPIService.
    assert names == {
        "cascade.v1.CascadeService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    api = descriptor_pb2.FileDescriptorProto.FromString(replies[1].file_descriptor_response.file_descriptor_proto[0])
    assert api.name == "cascade/v1/cascade.proto" and "GenerateRequest" in [m.name for m in api.message_type]
    itself = descriptor_pb2.FileDescriptorProto.FromString(replies[2].file_descriptor_response.file_descriptor_proto[0])
    assert itself.package == f"grpc.reflection.{version}"
    assert replies[3].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_bad_requests_fail_with_the_same_status_message_and_field(served, streaming):
    call = served.stub.GenerateStream if streaming else served.stub.Generate
    for request, field, message in BAD_REQUESTS:
        error = _error(call, request, timeout=60)
        assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        status = status_details(error)
        assert (status.code, status.message) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], message)
        bad = error_details_pb2.BadRequest()
        assert [d.Unpack(bad) for d in status.details if d.Is(bad.DESCRIPTOR)] == [True]
        assert [v.field for v in bad.field_violations] == [field]


def test_the_sdk_exposes_the_field_violations(served):
    _, field, message = BAD_REQUESTS[0]
    with CascadeClient(served.address, timeout_s=60) as client:
        for call in (
            lambda: client.generate("x", max_new_tokens=0),
            lambda: list(client.stream("x", max_new_tokens=0)),
        ):
            with pytest.raises(errors.InvalidArgument) as caught:
                call()
            assert caught.value.field_violations == (errors.FieldViolation(field, message),)


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_an_oversized_request_gets_the_same_final_status_naming_the_limit(served, streaming):
    # A client told to retry retries what can never succeed: every front end answers an oversized
    # request as the standalone server does, with a status no client retries, naming the limit.
    call = served.stub.GenerateStream if streaming else served.stub.Generate
    # Far past what a model can hold, but within the message limit (serving.admission.max_message_bytes,
    # by default a session's whole limit of token ids), then past that limit.
    prompt = pb.GenerateRequest(prompt="x" * 5_000_000, max_new_tokens=4)
    error = _error(call, prompt, timeout=120)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert error.details().startswith("prompt: "), error.details()  # the model's limit, named
    huge = pb.GenerateRequest(prompt="x" * (MAX_MESSAGE_BYTES + 1000), max_new_tokens=4)
    error = _error(call, huge, timeout=120)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (error.code(), error.details())
    assert str(MAX_MESSAGE_BYTES) in error.details(), error.details()
    trailers = dict(error.trailing_metadata() or ())
    if "grpc-status-details-bin" in trailers:  # ours, behind Ray's proxy (gRPC's own refusal has none)
        details = status_pb2.Status.FromString(trailers["grpc-status-details-bin"]).details
        assert not any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in details)  # retrying cannot help
    # The front end still serves afterwards.
    assert served.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=1), timeout=60).token_ids
    if not streaming:  # and over HTTP (on "ray", the replica's app behind Ray's HTTP proxy): 413, the limit named
        body = b'{"model": "target", "max_tokens": 4, "prompt": "' + b"x" * (MAX_MESSAGE_BYTES + 1) + b'"}'
        request = urllib.request.Request(
            served.http_url + "/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == 413
        assert str(MAX_MESSAGE_BYTES) in json.loads(caught.value.read())["error"]["message"]


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_an_unknown_session_is_not_found_in_one_line(served, streaming):
    call = served.stub.GenerateStream if streaming else served.stub.Generate
    error = _error(call, pb.GenerateRequest(session_id="no-such-session", prompt="x"), timeout=60)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.NOT_FOUND,
        "session_id: session 'no-such-session' not found",
    )
    assert status_details(error).code == grpc.StatusCode.NOT_FOUND.value[0]


def test_sessions_round_trip_and_their_errors_are_one_line(served, tiny_family):
    stub = served.stub
    session_id = f"conformance-{served.frontend}"
    created = stub.CreateSession(pb.CreateSessionRequest(session_id=session_id, prompt_token_ids=[5, 6, 7]), timeout=60)
    assert (created.session_id, list(created.token_ids)) == (session_id, [5, 6, 7])
    error = _error(stub.CreateSession, pb.CreateSessionRequest(session_id=session_id), timeout=60)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.ALREADY_EXISTS,
        f"session_id: session {session_id!r} already exists",
    )
    reply = stub.Generate(
        pb.GenerateRequest(session_id=session_id, prompt_token_ids=[8], max_new_tokens=6, temperature=0), timeout=120
    )
    assert list(reply.token_ids) == oracle(tiny_family["target"], [5, 6, 7, 8], 6)
    assert reply.session_length == 10
    stored = stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=60)
    assert list(stored.token_ids) == [5, 6, 7, 8, *reply.token_ids] and stored.version == 1
    assert stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), timeout=60).deleted
    error = _error(stub.GetSession, pb.GetSessionRequest(session_id=session_id), timeout=60)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.NOT_FOUND,
        f"session_id: session {session_id!r} not found",
    )


def test_a_deadline_and_a_cancel_end_the_call_with_their_status(served):
    long = pb.GenerateRequest(
        prompt_token_ids=[3, 4, 5], max_new_tokens=4000, temperature=0
    )  # within the 4,096 positions
    error = _error(served.stub.Generate, long, timeout=0.5)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stream = served.stub.GenerateStream(long, timeout=120)
    assert next(stream).token_ids  # under way
    stream.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        list(stream)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    # The service carries on.
    reply = served.stub.Generate(pb.GenerateRequest(prompt_token_ids=[3, 4, 5], max_new_tokens=4), timeout=120)
    assert len(reply.token_ids) == 4


def test_the_server_and_every_process_it_started_listen_on_loopback_only(served):
    found = procfs.listeners(procfs.descendants(served.process.pid))
    port = int(served.address.rsplit(":", 1)[1])
    assert any(p == port for _, p, _ in found)  # the frontend's own port is seen
    assert not procfs.beyond_loopback(found), procfs.beyond_loopback(found)


def test_a_node_js_client_sees_the_same_contract(served, tiny_family):
    """@grpc/grpc-js with the .proto loaded as it is: output, stream, errors with details, health."""
    node_client.ensure_installed()
    prompt = random_prompts(1, 9, seed=11)[0]
    seen = node_client.run_node_client(served.address, prompt, 8)
    expected = oracle(tiny_family["target"], prompt, 8)
    assert seen["generate"]["token_ids"] == expected, seen["generate"]
    assert seen["stream"]["token_ids"] == expected and seen["stream"]["status_code"] == 0, seen["stream"]
    assert seen["stream"]["finish_reason"] == "length"
    _, field, message = BAD_REQUESTS[0]
    for key in ("bad_unary", "bad_stream"):
        bad = seen[key]
        assert (bad["code"], bad["details"]) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], message), bad
        status = node_client.decode_status(bad["status_details_bin"])
        assert status is not None and status.message == message
        violation = error_details_pb2.BadRequest()
        assert [d.Unpack(violation) for d in status.details if d.Is(violation.DESCRIPTOR)] == [True]
        assert [v.field for v in violation.field_violations] == [field]
    assert seen["bad_stream"]["chunks"] == 0
    assert seen["not_found"]["code"] == grpc.StatusCode.NOT_FOUND.value[0], seen["not_found"]
    assert seen["not_found"]["details"] == "session_id: session 'no-such-session' not found"
    assert seen["health"] == "SERVING"
    # A seed fixes a sampled output (issue 59: "42" against 42 once differed on every front end)
    first, *again = seen["seeded"]
    assert isinstance(first, list) and len(first) == 8 and all(tokens == first for tokens in again), seen["seeded"]
    ours = served.stub.Generate(
        pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=8, temperature=1.0, seed=42), timeout=120
    )
    assert list(ours.token_ids) == first


def test_sigterm_drains_calls_in_flight_and_exits_0_within_the_grace_period(served):
    """Runs last for each frontend: it stops the server."""
    long = pb.GenerateRequest(
        prompt_token_ids=[3, 4, 5], max_new_tokens=4000, temperature=0
    )  # within the 4,096 positions
    stream = served.stub.GenerateStream(long, timeout=300)
    assert next(stream).token_ids  # a call in flight
    processes = tree(served.process.pid)
    served.process.send_signal(signal.SIGTERM)
    start = time.monotonic()
    ended: grpc.StatusCode
    try:
        for _ in stream:
            pass
        ended = grpc.StatusCode.OK  # it finished within the grace period
    except grpc.RpcError as exc:
        ended = exc.code()
        # A status a client can act on, with our message where the service gave one.
        assert ended == grpc.StatusCode.UNAVAILABLE, (ended, exc.details())
        assert "\n" not in (exc.details() or "") and "ray::" not in (exc.details() or "")
    code = served.process.wait(timeout=GRACE_S + TEARDOWN_BOUND_S)
    took = time.monotonic() - start
    assert code == 0
    assert took < GRACE_S + TEARDOWN_BOUND_S
    assert left_behind(processes) == {}  # Ray's processes too, on the edge and Ray's proxy
    assert ended in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
