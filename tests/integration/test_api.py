"""The gRPC edge without Ray: a real grpc.server on loopback, the real client SDK, tiny models.

Greedy output through the API equals `transformers` greedy `generate()` of the target (the oracle);
streaming yields the same tokens; sessions continue from their stored prefix; every bad field is
INVALID_ARGUMENT (or NOT_FOUND) with a message naming it, and the rich error details trailer with a
FieldViolation for that field; health checking and reflection answer.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cascade_service.api.server import start_server
from cascade_service.client import CascadeClient, errors
from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.core.cascade import Lookup
from cascade_service.inprocess import InProcess
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc
from cascade_service.sessions import MemoryStore
from cascade_service.zoo.tiny import random_prompts

from ..helpers.grpc_errors import BAD_REQUESTS, field_violations, status_details
from ..helpers.oracle import LOGPROB_TOLERANCE, oracle

PROMPT = random_prompts(1, 12, seed=21)[0]


@pytest.fixture(scope="module")
def engine(tiny_family):
    drafters = [
        ModelTierConfig("close", str(tiny_family["close"])),
        ModelTierConfig("mid", str(tiny_family["mid"])),
        MaGConfig(),
    ]
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        drafters,
        [[4, 2, 0], [0, 2, 6], [0, 0, 6]],
        1.5,
        Lookup(2, 10),
    )
    return InProcess(cascade)


@pytest.fixture(scope="module")
def address(engine):
    server, port = start_server(engine.coordinator(MemoryStore(), GenerationConfig(max_new_tokens=24)))
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def client(address):
    with CascadeClient(address, timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def stub(address):
    with grpc.insecure_channel(address) as channel:
        yield cascade_pb2_grpc.CascadeServiceStub(channel)


def test_greedy_generate_equals_transformers_and_streaming_yields_the_same(tiny_family, client):
    expected = oracle(tiny_family["target"], PROMPT, 30)
    result = client.generate(prompt_token_ids=PROMPT, max_new_tokens=30)
    assert result.token_ids == expected
    assert result.finish_reason == "length"
    assert result.stats["generated_tokens"] == 30 and result.stats["target_calls"] <= 30
    assert sum(result.stats["accepted_by_position"]) >= 0 and result.stats["mean_accepted_length"] >= 1.0
    chunks = list(client.stream(prompt_token_ids=PROMPT, max_new_tokens=30))
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == result.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].stats is not None
    assert client.generate(prompt_token_ids=PROMPT).token_ids == expected[:24]  # the server's default length


def test_speculation_per_request_gives_the_oracles_tokens_and_off_drafts_nothing(tiny_family, client):
    expected = oracle(tiny_family["target"], PROMPT, 24)
    off = client.generate(prompt_token_ids=PROMPT, speculation="off")
    fixed = client.generate(prompt_token_ids=PROMPT, speculation="fixed")
    assert off.token_ids == fixed.token_ids == expected
    assert off.stats["target_calls"] == 24 and not off.stats.get("drafted_by_position")
    assert all(not tier.get("calls") for name, tier in off.stats["tiers"].items() if name != "target"), off.stats
    assert fixed.stats["target_calls"] < 24
    streamed = [t for chunk in client.stream(prompt_token_ids=PROMPT, speculation="off") for t in chunk.token_ids]
    assert streamed == expected


def test_top_k_and_min_p_reach_the_final_review(tiny_family, client):
    # At temperature 1, top_k 1 (or a min_p only the most likely token passes) leaves the greedy path alone.
    expected = oracle(tiny_family["target"], PROMPT, 24)
    assert client.generate(prompt_token_ids=PROMPT, temperature=1.0, top_k=1, seed=5).token_ids == expected
    assert client.generate(prompt_token_ids=PROMPT, temperature=1.0, min_p=0.999, seed=5).token_ids == expected
    assert client.generate(prompt_token_ids=PROMPT, temperature=1.0, seed=5).token_ids != expected


def test_logit_bias_moves_greedy_output_as_transformers_does(tiny_family, client):
    plain = oracle(tiny_family["target"], PROMPT, 24)
    bias = {plain[0]: -100.0, plain[3]: -50.0, 9: 2.0}
    expected = oracle(tiny_family["target"], PROMPT, 24, logit_bias=bias)
    assert expected != plain
    assert client.generate(prompt_token_ids=PROMPT, logit_bias=bias).token_ids == expected


def test_a_prediction_keeps_the_output_and_its_tokens_are_counted(tiny_family, client, stub):
    expected = oracle(tiny_family["target"], PROMPT, 24)
    plain = client.generate(prompt_token_ids=PROMPT)
    for prediction in (expected, expected[:6] + [1, 2] + expected[8:], plain.text):
        got = client.generate(prompt_token_ids=PROMPT, prediction=prediction)
        assert got.token_ids == expected
        # Text is tokenized afresh, and the tiny family's byte-level tokenizer does not give the ids back
        # from their (lossy) text: only the ids are sure to be kept.
        if not isinstance(prediction, str):
            assert got.stats["accepted_prediction_tokens"] > 0, got.stats
    exact = client.generate(prompt_token_ids=PROMPT, prediction=expected)
    assert exact.stats["target_calls"] < plain.stats["target_calls"]
    both = pb.GenerateRequest(prompt_token_ids=PROMPT, prediction=pb.Prediction(content="x", token_ids=[1]))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(both, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prediction" in caught.value.details()


def test_logprobs_come_with_the_reply_and_with_each_chunk(engine, client):
    expected = engine.generate(PROMPT, GenerationConfig(max_new_tokens=24, logprobs=3)).stats.logprobs
    reply = client.generate(prompt_token_ids=PROMPT, logprobs=3)
    assert [t["token_id"] for t in reply.logprobs] == reply.token_ids == [t.token for t in expected]
    # which rounds drafted is the floor's decision from timings, so values agree to LOGPROB_TOLERANCE
    for got, want in zip(reply.logprobs, expected, strict=True):
        assert abs(got["logprob"] - want.logprob) < LOGPROB_TOLERANCE and [a["token_id"] for a in got["top"]] == [
            i for i, _ in want.top
        ]
    chunks = list(client.stream(prompt_token_ids=PROMPT, logprobs=3))
    streamed = [t for c in chunks for t in c.logprobs]  # the same tokens; their values as close as above
    assert [t["token_id"] for t in streamed] == reply.token_ids
    for got, want in zip(streamed, reply.logprobs, strict=True):
        assert abs(got["logprob"] - want["logprob"]) < LOGPROB_TOLERANCE and len(got["top"]) == len(want["top"]) == 3
    assert client.generate(prompt_token_ids=PROMPT).logprobs == []


def test_a_response_format_constrains_the_output(client):
    import re

    reply = client.generate(prompt_token_ids=PROMPT, response_format={"regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", reply.text) and reply.finish_reason == "eos", reply.text


def test_a_session_continues_from_its_stored_prefix(tiny_family, client):
    session = client.create_session(prompt_token_ids=PROMPT[:5])
    first = client.generate(prompt_token_ids=PROMPT[5:], session_id=session.session_id, max_new_tokens=8)
    assert first.token_ids == oracle(tiny_family["target"], PROMPT, 8)
    assert first.session_length == len(PROMPT) + 8
    more = [7, 8, 9]
    second = client.generate(prompt_token_ids=more, session_id=session.session_id, max_new_tokens=8)
    history = PROMPT + first.token_ids + more
    assert second.token_ids == oracle(tiny_family["target"], history, 8)
    stored = client.get_session(session.session_id)
    assert stored.token_ids == history + second.token_ids and stored.version == 2
    assert client.delete_session(session.session_id) is True
    with pytest.raises(errors.NotFound, match="session_id"):
        client.get_session(session.session_id)


def test_stop_strings_end_the_output_before_the_stop(engine, client):
    full = client.generate(prompt_token_ids=PROMPT, max_new_tokens=30)
    stop = full.text[10:13]
    assert stop and stop in full.text
    cut = client.generate(prompt_token_ids=PROMPT, max_new_tokens=30, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids
    assert stop in engine.decode_text(cut.token_ids) and stop not in engine.decode_text(cut.token_ids[:-1])
    streamed = list(client.stream(prompt_token_ids=PROMPT, max_new_tokens=30, stop=[stop]))
    assert "".join(c.text for c in streamed) == cut.text


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": [1, 2, 10**6]}, "prompt_token_ids"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt_token_ids": [1, 2], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt_token_ids": [1, 2], "max_new_tokens": 10**6}, "max_new_tokens"),
        ({"prompt_token_ids": [1, 2], "temperature": -1.0}, "temperature"),
        ({"prompt_token_ids": [1, 2], "top_p": 0.0}, "top_p"),
        ({"prompt_token_ids": [1, 2], "top_p": 1.5}, "top_p"),
        ({"prompt_token_ids": [1, 2], "stop": [""]}, "stop"),
        ({"prompt_token_ids": [1, 2], "verification": "telepathy"}, "verification.rule"),
        ({"prompt_token_ids": [1, 2], "session_id": "bad id!"}, "session_id"),
        ({"prompt_token_ids": [1, 2], "stop_threshold": 1.5}, "stop_threshold"),
        ({"prompt_token_ids": [1, 2], "stop_threshold": 0.0}, "stop_threshold"),
        # In range, but this cascade has no acceptance head to apply it to: refused, not ignored.
        ({"prompt_token_ids": [1, 2], "stop_threshold": 0.5}, "stop_threshold: no tier"),
        ({"prompt_token_ids": [1, 2], "speculation": "sometimes"}, "speculation.mode"),
        ({"prompt_token_ids": [1, 2], "top_k": 1 << 21}, "top_k"),
        ({"prompt_token_ids": [1, 2], "min_p": 1.0}, "min_p"),
        ({"prompt_token_ids": [1, 2], "logit_bias": {i: 1.0 for i in range(2000)}}, "logit_bias"),
        ({"prompt_token_ids": [1, 2], "logit_bias": {10**6: 1.0}}, "logit_bias: 1000000 is outside the vocabulary"),
        ({"prompt_token_ids": [1, 2], "logit_bias": {3: 200.0}}, "logit_bias"),
        ({"prompt_token_ids": [1, 2], "prediction": [10**6]}, "prediction: 1000000 is outside the vocabulary"),
        ({"prompt_token_ids": [1, 2], "repetition_penalty": 0.0}, "repetition_penalty"),
        ({"prompt_token_ids": [1, 2], "logprobs": 21}, "logprobs"),
        ({"prompt_token_ids": [1, 2], "response_format": {"regex": "[0-9"}}, "response_format"),
        ({"prompt_token_ids": [1, 2], "response_format": {"json_schema": "x" * (1 << 20)}}, "response_format"),
        ({"prompt_token_ids": [1, 2], "response_format": {"json_schema": {"$ref": "#/none"}}}, "response_format"),
        # nested past Python's parser (it recursed into an INTERNAL) and past llguidance's limit
        (
            {"prompt_token_ids": [1, 2], "response_format": {"json_schema": '{"items":' * 5000 + "{}" + "}" * 5000}},
            "response_format",
        ),
        (
            {"prompt_token_ids": [1, 2], "response_format": {"json_schema": '{"items":' * 900 + "{}" + "}" * 900}},
            "response_format",
        ),
        (
            {"prompt_token_ids": [1, 2], "response_format": {"json_object": True, "whitespace": "tabs"}},
            "response_format.whitespace",
        ),
        (
            {"prompt_token_ids": [1, 2], "response_format": {"regex": "[0-9]", "whitespace": "free"}},
            "response_format.whitespace",
        ),
        ({"prompt_token_ids": [1, 2], "presence_penalty": 3.0}, "presence_penalty"),
        ({"prompt_token_ids": [1, 2], "frequency_penalty": -2.5}, "frequency_penalty"),
        ({"prompt_token_ids": [1, 2], "prediction": list(range(40000))}, "prediction"),
        ({"prompt_token_ids": [1, 2], "speculation": "OFF"}, "speculation.mode"),
        ({"prompt_token_ids": [1, 2], "target_row": [4, 2]}, "speculation.target_row"),
        ({"prompt_token_ids": [1, 2], "target_row": [0, 4, 0]}, "speculation.target_row"),
    ],
)
def test_bad_fields_are_invalid_argument_naming_the_field(client, kwargs, field):
    name = field.split(":")[0]  # the field path, without the rest of the message matched
    for call in (lambda: client.generate(**kwargs), lambda: list(client.stream(**kwargs))):
        with pytest.raises(errors.InvalidArgument, match=field.replace(".", r"\.")) as caught:
            call()
        assert caught.value.field_violations == (errors.FieldViolation(name, caught.value.details),)


def _failed(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        reply = call(request, timeout=60)
        if not isinstance(reply, pb.GenerateResponse):
            list(reply)  # a stream fails while it is read
    return caught.value


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_bad_requests_carry_a_status_trailer_with_the_field(stub, streaming):
    call = stub.GenerateStream if streaming else stub.Generate
    for request, field, message in BAD_REQUESTS:
        error = _failed(call, request)
        assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        status = status_details(error)
        assert (status.code, status.message) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], message)
        assert len(status.details) == 1 and field_violations(status) == [field]


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_an_unknown_session_carries_a_trailer_without_a_field_violation(stub, streaming):
    call = stub.GenerateStream if streaming else stub.Generate
    error = _failed(call, pb.GenerateRequest(prompt="x", session_id="no-such-session"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    status = status_details(error)
    assert (status.code, status.message) == (grpc.StatusCode.NOT_FOUND.value[0], error.details())
    assert list(status.details) == []


def test_unknown_session_is_not_found_and_the_server_keeps_answering(tiny_family, client):
    with pytest.raises(errors.NotFound, match="session_id"):
        client.generate(prompt_token_ids=[1, 2], session_id="no-such-session")
    with pytest.raises(errors.InvalidArgument, match="session_id") as caught:
        client.get_session("")
    assert caught.value.field_violations == (errors.FieldViolation("session_id", "session_id: required"),)
    assert client.generate(prompt_token_ids=PROMPT, max_new_tokens=5).token_ids == oracle(
        tiny_family["target"], PROMPT, 5
    )


def test_health_and_reflection(client, engine):
    assert client.health() == "SERVING"
    server, port = start_server(engine.coordinator(MemoryStore()))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            names = {s.name for s in reply.list_services_response.service}
            assert {"cascade.v1.CascadeService", "grpc.health.v1.Health"} <= names
    finally:
        server.stop(0)
