"""The controls applications use daily, driven by the real `openai` client on every front end (a `serve`
process per front end, as test_conformance starts them: tests/e2e/conftest.py), each against the same
request over gRPC or the `transformers` oracle: logit_bias, penalties, top_k and min_p, logprobs, n and best_of (unary
and streamed; gRPC's `n` too), a predicted output, response formats."""

from __future__ import annotations

import json
import re

import openai
import pytest

from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle

PROMPT = random_prompts(1, 9, seed=12)[0]
N = 12


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=120)


def _grpc(served, **fields) -> pb.GenerateResponse:
    return served.stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=N, **fields), timeout=120)


def test_bias_and_penalties_move_the_text_as_the_oracle_and_grpc(served, client, tiny_family):
    plain = oracle(tiny_family["target"], PROMPT, N)
    bias = {plain[0]: -100.0, 7: 3.0}
    reply = client.completions.create(
        model="target", prompt=PROMPT, max_tokens=N, temperature=0, logit_bias={str(t): b for t, b in bias.items()}
    )
    direct = _grpc(served, logit_bias=bias)
    assert list(direct.token_ids) == oracle(tiny_family["target"], PROMPT, N, logit_bias=bias) != plain
    assert reply.choices[0].text == direct.text
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    reply = client.completions.create(
        model="target", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"repetition_penalty": 1.4} | penalties
    )
    direct = _grpc(served, repetition_penalty=1.4, **penalties)
    assert reply.choices[0].text == direct.text
    # top_k 1 at temperature 1 leaves one token to draw: the greedy text, with min_p beside it
    top1 = client.completions.create(
        model="target", prompt=PROMPT, max_tokens=N, temperature=1.0, seed=3, extra_body={"top_k": 1, "min_p": 0.5}
    )
    assert top1.choices[0].text == _grpc(served, temperature=0).text


def test_logprobs_and_choices_as_grpc_gives_them(served, client):
    direct = _grpc(served, logprobs=2)
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2)
    assert reply.choices[0].logprobs.token_logprobs == pytest.approx([t.logprob for t in direct.logprobs], abs=1e-5)
    assert all(len(top) <= 2 for top in reply.choices[0].logprobs.top_logprobs)
    several = client.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0, n=2, best_of=3)
    assert [c.text for c in several.choices] == [direct.text, direct.text]
    assert [c.text for c in _grpc(served, n=2, temperature=0).choices] == [direct.text, direct.text]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model="target", prompt=PROMPT, max_tokens=N, temperature=0, n=2, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: direct.text, 1: direct.text}


def _greedy(client, **extra):
    """A greedy completion of PROMPT with `extra` as extra body fields."""
    return client.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0, extra_body=extra)


def test_a_prediction_and_response_formats_as_grpc_gives_them(served, client):
    text = _grpc(served).text
    predicted = _greedy(client, prediction={"type": "content", "content": text})
    assert predicted.choices[0].text == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0, details
    regex = r"[0-9]{3}-[a-z]{2,4}"
    reply = _greedy(client, response_format={"type": "regex", "regex": regex})
    direct = _grpc(served, response_format=pb.ResponseFormat(regex=regex))
    assert reply.choices[0].text == direct.text and re.fullmatch(regex, reply.choices[0].text)
    schema = {
        "type": "object",
        "properties": {"size": {"enum": [1, 2, 3]}},
        "required": ["size"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    reply = _greedy(client, response_format={"type": "json_schema", "json_schema": {"name": "size", "schema": schema}})
    assert json.loads(reply.choices[0].text)["size"] in (1, 2, 3)
    with pytest.raises(openai.BadRequestError) as caught:
        _greedy(client, response_format={"type": "regex", "regex": "[0-9"})
    assert caught.value.body["param"] == "response_format"
