"""Limits that match the model: a request's context plus its new tokens fit the positions every tier holds.

The GPT-2 tiny family holds 2,048 positions (a learned position table: one more would index out of
range). A request that fills the context exactly is served, exact against `transformers`; one past it
is refused before any work, naming the field; a server default of max_new_tokens is cut to what fits;
a session cannot grow past the context, and one that could not be continued is refused at creation.
"""

from __future__ import annotations

import random

import grpc
import pytest

from cascade_service.api.server import start_server
from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.inprocess import InProcess
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc
from cascade_service.sessions import MemoryStore

from ..helpers.oracle import oracle

CONTEXT = 2048


@pytest.fixture(scope="module")
def family(tiny_family_factory):
    return tiny_family_factory("gpt2")


@pytest.fixture(scope="module")
def coordinator(family):
    cascade = make_cascade(
        ModelTierConfig("target", str(family["target"])),
        [ModelTierConfig("mid", str(family["mid"])), MaGConfig()],
        [[4, 2], [0, 6]],
        1.5,
    )
    return InProcess(cascade).coordinator(MemoryStore(), GenerationConfig(max_new_tokens=16))


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def test_the_context_is_the_smallest_tiers_positions(coordinator):
    assert coordinator.max_context == CONTEXT
    assert coordinator.max_prompt_tokens == CONTEXT - 1


def test_a_request_that_fills_the_context_exactly_is_exact(coordinator, family):
    prompt = _prompt(CONTEXT - 8)
    result = coordinator.generate(coordinator.params(prompt_ids=prompt, max_new_tokens=8, temperature=0))
    assert result.token_ids == oracle(family["target"], prompt, 8)
    # The server's default (16) is cut to the 8 that fit.
    result = coordinator.generate(coordinator.params(prompt_ids=prompt, temperature=0))
    assert result.token_ids == oracle(family["target"], prompt, 8) and result.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt_len, max_new, message",
    [
        (
            CONTEXT - 8,
            9,
            (
                "max_new_tokens: the prompt's 2040 tokens plus max_new_tokens 9 exceed the model's "
                "context of 2048 positions (at most 8 new tokens fit)"
            ),
        ),
        (CONTEXT, None, "prompt: 2048 tokens, more than the limit of 2047 (the model holds 2048 positions)"),
        (40_000, None, "prompt: 40000 tokens, more than the limit of 2047 (the model holds 2048 positions)"),
    ],
)
def test_past_the_context_is_refused_before_any_work(coordinator, prompt_len, max_new, message):
    with pytest.raises(ValueError) as caught:
        coordinator.params(prompt_ids=_prompt(prompt_len), max_new_tokens=max_new)
    assert str(caught.value) == message


def test_a_session_cannot_outgrow_the_context(coordinator, family):
    history = _prompt(CONTEXT - 48, seed=1)
    record = coordinator.create_session(prompt_ids=history)
    with pytest.raises(ValueError) as caught:
        coordinator.generate(coordinator.params(session_id=record.session_id, prompt_ids=[5] * 40, max_new_tokens=9))
    assert str(caught.value).startswith(
        "max_new_tokens: the session's 2000 tokens plus the prompt's 40 plus max_new_tokens 9 exceed"
    )
    assert coordinator.get_session(record.session_id).token_ids == tuple(history)  # no effect
    result = coordinator.generate(
        coordinator.params(session_id=record.session_id, prompt_ids=[5] * 40, temperature=0)
    )  # the default, cut to 8
    assert result.token_ids == oracle(family["target"], history + [5] * 40, 8)
    assert result.session_length == CONTEXT
    with pytest.raises(ValueError, match="^prompt: the session's 2048 tokens plus the prompt's 1 leave no room"):
        coordinator.generate(coordinator.params(session_id=record.session_id, prompt_ids=[5]))
    with pytest.raises(ValueError, match="^prompt: 2048 tokens, more than the limit of 2047"):
        coordinator.create_session(prompt_ids=_prompt(CONTEXT))


def test_over_grpc_the_limit_is_invalid_argument_naming_the_field(coordinator):
    server, port = start_server(coordinator)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cascade_pb2_grpc.CascadeServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(pb.GenerateRequest(prompt_token_ids=_prompt(CONTEXT - 4), max_new_tokens=5), timeout=60)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith("max_new_tokens: the prompt's 2044 tokens")
            with pytest.raises(grpc.RpcError) as caught:
                stub.CreateSession(pb.CreateSessionRequest(prompt_token_ids=_prompt(CONTEXT)), timeout=60)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith("prompt: 2048 tokens")
    finally:
        server.stop(0)


def test_a_session_quota_is_resource_exhausted_and_leaves_nothing_stored(family):
    cascade = make_cascade(ModelTierConfig("target", str(family["target"])), [MaGConfig()], [[4]], 1.0)
    store = MemoryStore(max_sessions_per_owner=1)
    server, port = start_server(InProcess(cascade).coordinator(store))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cascade_pb2_grpc.CascadeServiceStub(channel)
            stub.CreateSession(pb.CreateSessionRequest(session_id="first", prompt_token_ids=[5]), timeout=60)
            with pytest.raises(grpc.RpcError) as caught:
                stub.CreateSession(pb.CreateSessionRequest(session_id="second", prompt_token_ids=[5]), timeout=60)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.details().startswith("this API key holds 1 sessions, its limit")
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetSession(pb.GetSessionRequest(session_id="second"), timeout=60)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND  # the refused call stored nothing
    finally:
        server.stop(0)


def test_a_session_of_the_stores_whole_limit_fits_one_grpc_message(coordinator):
    # The transport never refuses first: a CreateSession carrying MAX_SESSION_TOKENS ids (up to 5 bytes
    # each on the wire, the largest ids here) reaches the service, which names the model's limit.
    from cascade_service.api.admission import MAX_REQUEST_BYTES
    from cascade_service.sessions import MAX_SESSION_TOKENS

    request = pb.CreateSessionRequest(prompt_token_ids=[2**31 - 1] * MAX_SESSION_TOKENS)
    assert request.ByteSize() <= MAX_REQUEST_BYTES
    server, port = start_server(coordinator)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cascade_pb2_grpc.CascadeServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.CreateSession(request, timeout=120)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith("prompt")
    finally:
        server.stop(0)
