"""`n` and `best_of` over gRPC (api.choices): the candidates decode together as sibling tasks of the
engine loop, each with its own seed; greedy choices equal the oracle; best_of keeps the likeliest; bad
counts, a stream or a session with several choices are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest

from cascade_service.api.server import start_server
from cascade_service.client import CascadeClient, errors
from cascade_service.config import GenerationConfig
from cascade_service.core.cascade import Lookup
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc
from cascade_service.sessions import MemoryStore
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import make_engine, oracle

PROMPT = random_prompts(1, 12, seed=22)[0]
N = 16


@pytest.fixture(scope="module")
def address(tiny_family):
    shape = ["close", "mid", "mag"], [[4, 2, 0], [0, 2, 6], [0, 0, 6]]
    engine = make_engine(tiny_family, *shape, 1.5, lookup=Lookup(2, 10))
    server, port = start_server(engine.coordinator(MemoryStore(), GenerationConfig(max_new_tokens=N)))
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def client(address):
    with CascadeClient(address, timeout_s=120) as c:
        yield c


def test_greedy_choices_each_equal_the_oracle(client, tiny_family):
    reply = client.generate(prompt_token_ids=PROMPT, max_new_tokens=N, temperature=0, n=3)
    expected = oracle(tiny_family["target"], PROMPT, N)
    assert [c.token_ids for c in reply.choices] == [expected] * 3
    assert reply.token_ids == [] and all(c.finish_reason == "length" for c in reply.choices)
    assert all(c.stats["generated_tokens"] == N for c in reply.choices)


def test_sampled_choices_take_the_seed_plus_their_index_and_best_of_keeps_the_likeliest(client):
    sampled = client.generate(prompt_token_ids=PROMPT, max_new_tokens=N, temperature=1.0, seed=7, n=4)
    assert len(sampled.choices) == 4 and len({tuple(c.token_ids) for c in sampled.choices}) > 1
    best = client.generate(
        prompt_token_ids=PROMPT, max_new_tokens=N, temperature=1.0, seed=7, n=2, best_of=5, logprobs=0
    )
    means = [sum(t["logprob"] for t in c.logprobs) / len(c.logprobs) for c in best.choices]
    assert len(means) == 2 and means[0] >= means[1]
    ranked_only = client.generate(prompt_token_ids=PROMPT, max_new_tokens=N, temperature=1.0, n=1, best_of=3)
    assert len(ranked_only.choices) == 1 and ranked_only.choices[0].logprobs == []  # logprobs were not asked


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 17}, "best_of"),
        ({"n": 2, "session_id": "any-session"}, "n"),
        ({"n": 2, "temperature": -1.0}, "temperature"),  # each candidate's fields are checked before any decode
    ],
)
def test_bad_choice_counts_are_invalid_argument_naming_the_field(client, kwargs, field):
    with pytest.raises(errors.InvalidArgument) as caught:
        client.generate(prompt_token_ids=PROMPT, max_new_tokens=4, **kwargs)
    assert [v.field for v in caught.value.field_violations] == [field], caught.value


def test_on_the_wire_each_choice_says_its_seed_and_a_stream_has_one_choice(address):
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=4, n=3, seed=7, temperature=1.0)
    with grpc.insecure_channel(address) as channel:
        stub = cascade_pb2_grpc.CascadeServiceStub(channel)
        reply = stub.Generate(request, timeout=60)
        assert [(c.index, c.seed) for c in reply.choices] == [(0, 7), (1, 8), (2, 9)]
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.GenerateStream(request, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith("n:")
