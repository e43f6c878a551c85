"""The tier API as a hostile client meets it: precise status codes, and the server keeps serving.

Raw gRPC calls to a tier server (cascade.tier.v1.Tier) on loopback: malformed bytes, a tier it does
not host, token ids outside the vocabulary, oversized blocks, an empty request id, an unknown request
id, a review asked of MaG, no key where keys are required; then a hypothesis fuzz of random messages.
After each, a good call still works. Health and reflection are served.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cascade_service.proto.tier.v1 import tier_pb2 as pb
from cascade_service.rpc.auth import load_api_keys
from cascade_service.tierhost.server import SERVICE

from ..helpers.access import KEY_A, write_keys
from ..helpers.tier_servers import serve_group, tiny_cascade

VOCAB = 320  # the tiny family's


@pytest.fixture(scope="module")
def server(tiny_family):
    server = serve_group(tiny_cascade(tiny_family), ["mid", "mag"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def channel(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield channel
    channel.close()


def _call(channel, method: str, message, metadata=None) -> bytes:
    data = message if isinstance(message, bytes) else message.SerializeToString()
    return channel.unary_unary(f"/{SERVICE}/{method}")(data, timeout=30, metadata=metadata)


def _draft(tier="mid", tokens=(1, 2, 3), limit=4, request_id="r-1", **fields) -> pb.DraftRequest:
    context = pb.Context(tokens=list(tokens), stable=len(tokens))
    return pb.DraftRequest(request_id=request_id, tier=tier, context=context, want=limit, limit=limit, **fields)


def _refused(channel, method, message, code, match, metadata=None):
    with pytest.raises(grpc.RpcError) as info:
        _call(channel, method, message, metadata)
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()
    _still_serving(channel)


def _still_serving(channel):
    reply = pb.DraftReply.FromString(_call(channel, "Draft", _draft(request_id="good")))
    assert 1 <= len(reply.block.tokens) <= 4 and reply.usage.tiers["mid"].calls >= 1


def test_info_says_what_the_server_hosts(channel):
    tiers = {t.name: t for t in pb.InfoReply.FromString(_call(channel, "Info", pb.InfoRequest())).tiers}
    assert set(tiers) == {"mid", "mag"}
    assert tiers["mid"].vocab_size == VOCAB and tiers["mid"].num_parameters > 0 and tiers["mid"].system
    assert tiers["mag"].vocab_size == VOCAB and not tiers["mag"].system


@pytest.mark.parametrize(
    "method, message, code, match",
    [
        ("Draft", b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "malformed DraftRequest"),
        ("Review", b"\x0a\xff", grpc.StatusCode.INVALID_ARGUMENT, "malformed ReviewRequest"),
        ("Info", b"\xff", grpc.StatusCode.INVALID_ARGUMENT, ""),
        ("Draft", _draft(tier="target"), grpc.StatusCode.NOT_FOUND, "'target' is not served here"),
        ("Draft", _draft(tokens=(1, VOCAB)), grpc.StatusCode.INVALID_ARGUMENT, f"context.tokens: token id {VOCAB}"),
        ("Draft", _draft(tokens=(1, -5)), grpc.StatusCode.INVALID_ARGUMENT, "context.tokens: token id -5"),
        ("Draft", _draft(tier="mag", tokens=(VOCAB + 9,)), grpc.StatusCode.INVALID_ARGUMENT, "context.tokens"),
        ("Draft", _draft(limit=10**6), grpc.StatusCode.INVALID_ARGUMENT, "limit: 1000000 tokens in one block"),
        ("Draft", _draft(tokens=()), grpc.StatusCode.INVALID_ARGUMENT, "context.tokens: empty"),
        ("Draft", _draft(request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty"),
        (
            "Draft",
            _draft(sampling=pb.Sampling(temperature=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
        (
            "Review",
            pb.ReviewRequest(
                request_id="r",
                tier="mid",
                context=pb.Context(tokens=[1, 2], stable=2),
                block=pb.Block(tokens=[VOCAB + 1], token_probs=[1.0]),
                leniency=1.0,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "block.tokens: token id",
        ),
        (
            "Review",
            pb.ReviewRequest(request_id="r", tier="mag", context=pb.Context(tokens=[1], stable=1), leniency=1.0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "'mag' drafts but cannot review",
        ),
    ],
)
def test_bad_calls_get_precise_codes_and_the_server_keeps_serving(channel, method, message, code, match):
    _refused(channel, method, message, code, match)


def test_an_unknown_request_id_is_no_error(channel):
    assert not pb.ReleaseReply.FromString(_call(channel, "Release", pb.ReleaseRequest(request_id="never-seen"))).held
    # A delta for a request the server never saw: "resend", not an error and not a wrong answer.
    delta = _draft(request_id="never-seen-either")
    delta.context.offset, delta.context.prefix = 2, 12345
    assert pb.DraftReply.FromString(_call(channel, "Draft", delta)).resend


def test_health_and_reflection_are_served(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE):
        assert (
            stub.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        )
    from cascade_service.rpc.reflection import ServerReflectionRequest, v1_info

    replies = list(v1_info(channel)(iter([ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


def test_a_server_with_keys_refuses_calls_without_one(tiny_family, tmp_path):
    from cascade_service.cli.tier import tier_group
    from cascade_service.config import Config
    from cascade_service.tierhost.server import start_tier_server

    keys = load_api_keys(write_keys(tmp_path / "keys"))
    server = start_tier_server(tier_group(Config(tiny_cascade(tiny_family)), ["mag"]), api_keys=keys)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        for metadata in (None, (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                _call(channel, "Info", pb.InfoRequest(), metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", f"Bearer {KEY_A}"),)
        assert pb.InfoReply.FromString(_call(channel, "Info", pb.InfoRequest(), good)).tiers[0].name == "mag"
    finally:
        channel.close()
        server.stop()


def _fuzzed(tier: str, tokens: list[int], stable: int, offset: int, limit: int, rid: str) -> bytes:
    message = _draft(tier, tokens, limit, rid)
    message.context.stable, message.context.offset = stable, offset
    return message.SerializeToString()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(["Draft", "Review", "Release", "Info"]),
    data=st.one_of(
        st.binary(max_size=64),
        st.builds(
            _fuzzed,
            st.sampled_from(["mid", "mag", "x", ""]),
            st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
            st.integers(0, 2**32 - 1),
            st.integers(0, 16),
            st.integers(0, 2**32 - 1),
            st.text(max_size=8),
        ),
    ),
)
def test_fuzzed_calls_never_break_the_server(channel, method, data):
    try:
        _call(channel, method, data)
    except grpc.RpcError as error:
        assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), error.details()
    _still_serving(channel)
