"""The OpenAI-compatible HTTP API of the standalone server, with the real `openai` package as client,
and curl for the SSE framing; `/metrics` in Prometheus' text format with the `cascade:` names."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from cascade_service.api.admission import MAX_REQUEST_BYTES
from cascade_service.standalone import start_standalone
from cascade_service.zoo.tiny import random_prompts

from ..helpers.access import KEY_A
from ..helpers.openai_server import PROMPT, N, openai_client, openai_server
from ..helpers.oracle import LOGPROB_TOLERANCE, oracle


@pytest.fixture(scope="module")
def server(tiny_family, tmp_path_factory):
    with openai_server(tiny_family, tmp_path_factory.mktemp("keys")) as standalone:
        yield standalone


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_completions_stream_and_not_give_the_same_greedy_text_as_grpc(server, client, tiny_family):
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0, stream=True)
        if chunk.choices
    )
    assert reply.choices[0].text == streamed
    assert reply.usage.prompt_tokens == len(PROMPT) and reply.usage.completion_tokens == N
    assert reply.choices[0].finish_reason == "length"
    cascade = reply.model_extra["cascade"]
    assert cascade["target_calls"] > 0
    # The same request over gRPC gives the same text, and the oracle's tokens.
    from cascade_service.client import CascadeClient

    with CascadeClient(f"127.0.0.1:{server.port}", api_key=KEY_A) as grpc_client:
        direct = grpc_client.generate(prompt_token_ids=PROMPT, max_new_tokens=N)
    assert reply.choices[0].text == direct.text
    assert list(direct.token_ids) == oracle(tiny_family["target"], PROMPT, N)


def test_models_lists_the_target(client):
    assert [m.id for m in client.models.list().data] == ["target"]


@pytest.mark.parametrize(
    "fields, status, param",
    [
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"temperature": -1}, 400, "temperature"),
        ({"n": 17}, 400, "n"),
        ({"n": 0}, 400, "n"),
        ({"n": 3, "best_of": 2}, 400, "best_of"),
        ({"n": 2, "best_of": 3, "stream": True}, 400, "best_of"),
        ({"verification": {"rule": "bogus"}}, 400, "verification.rule"),
        ({"stop_threshold": 0.5}, 400, "stop_threshold"),
        ({"bogus_field": 1}, 400, "bogus_field"),
        ({"speculation": {"mode": "sometimes"}}, 400, "speculation.mode"),
        ({"top_k": -1}, 400, "top_k"),
        ({"top_k": 2.5}, 400, "top_k"),
        ({"min_p": 1.5}, 400, "min_p"),
        ({"logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"logprobs": 21}, 400, "logprobs"),
        ({"response_format": {"type": "yaml"}}, 400, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}},
            400,
            "response_format",
        ),
        ({"response_format": {"type": "regex", "regex": "(("}}, 400, "response_format"),
        ({"response_format": {"type": "json_object", "whitespace": "tabs"}}, 400, "response_format.whitespace"),
        ({"response_format": {"type": "json_object", "whitespace": 1}}, 400, "response_format.whitespace"),
        ({"logprobs": True}, 400, "logprobs"),
        ({"frequency_penalty": "high"}, 400, "frequency_penalty"),
        ({"repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"prediction": "text"}, 400, "prediction"),
        ({"prediction": {"type": "other", "content": "x"}}, 400, "prediction"),
        ({"prediction": {"type": "content", "content": 5}}, 400, "prediction.content"),
        ({"prediction": {"type": "content", "content": [{"type": "image"}]}}, 400, "prediction.content"),
        ({"logit_bias": {"3": "x"}}, 400, "logit_bias"),
        ({"logit_bias": {"3": 101}}, 400, "logit_bias"),
        ({"logit_bias": {"4000000000": 1}}, 400, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(5000)}}, 400, "logit_bias"),
        ({"speculation": {"mode": 0}}, 400, "speculation.mode"),
        ({"speculation": "off"}, 400, "speculation"),
        ({"speculation": {"mode": "off", "k_matrix": [[1]]}}, 400, "speculation"),
        ({"speculation": {"target_row": [4, 2]}}, 400, "speculation.target_row"),
        ({"speculation": {"target_row": "4,2,0"}}, 400, "speculation.target_row"),
    ],
)
def test_bad_fields_are_400s_naming_the_field(server, fields, status, param):
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 4} | fields
    code, reply = _post(server, "/v1/completions", body)
    assert code == status, reply
    error = reply["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_keys_and_models_are_checked(server, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).completions.create(
            model="target", prompt="x", max_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("depth, param", [(900, "response_format"), (990, None), (100_000, None)])
def test_json_nested_past_the_parsers_limit_is_a_400_not_a_500(server, depth, param):
    # Python's JSON parser recurses per level: a body nested 10^5 deep was a 500 (RecursionError).
    schema = '{"items":' * depth + "{}" + "}" * depth
    body = json.dumps({"model": "target", "prompt": PROMPT, "max_tokens": 4})[:-1]
    body += ', "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + schema + "}}}"
    code, reply = _post(server, "/v1/completions", body.encode())
    assert code == 400 and reply["error"]["param"] == param, reply


def _post(server, path: str, body: dict | bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}{path}",
        data=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_sse_framing_with_curl(server):
    assert shutil.which("curl"), "curl is part of the CI image"
    body = json.dumps({"model": "target", "prompt": PROMPT, "max_tokens": 6, "stream": True})
    out = subprocess.run(
        [
            "curl",
            "-sN",
            f"http://127.0.0.1:{server.http_port}/v1/completions",
            "-H",
            f"Authorization: Bearer {KEY_A}",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "cascade" in chunks[-1]


def test_metrics_are_exported_with_cascade_names(server, client):
    client.completions.create(model="target", prompt=PROMPT, max_tokens=8)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    for name in (
        "cascade:spec_decode_num_drafts_total",
        "cascade:spec_decode_num_draft_tokens_total",
        "cascade:spec_decode_num_accepted_tokens_total",
        "cascade:spec_decode_num_accepted_tokens_per_pos_total",
        "cascade:generation_tokens_total",
        "cascade:time_to_first_token_seconds_bucket",
        "cascade:e2e_request_latency_seconds_count",
        "cascade:num_requests_running",
        "cascade:tier_calls_total",
        "cascade:requests_rejected_total",
    ):
        assert name in text, name
    assert 'cascade:spec_decode_num_drafts_total{tier="target"}' in text
    assert 'cascade:spec_decode_num_draft_tokens_total{drafter="close",tier="target"}' in text


def test_chat_works_where_the_tokenizer_has_a_template(test_zoo_home, monkeypatch):
    # The zoo's tokenizers ship a chat template (zoo.build.CHAT_TEMPLATE): a chat is a prompt of comments.
    from cascade_service.config import load_config
    from cascade_service.models.hf import load_tokenizer

    monkeypatch.setenv("CASCADE_SERVICE_HOME", str(test_zoo_home))
    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "presets" / "test.yaml")
    messages = [{"role": "user", "content": "sum a list"}]
    rendered = load_tokenizer(config.cascade.target.path).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == "# user: sum a list\n# assistant:\n"
    standalone = start_standalone(config, http_port=0)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{standalone.http_port}/v1", api_key="none", max_retries=0)
        model = config.cascade.target.name
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        plain = client.completions.create(model=model, prompt=rendered, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == plain.choices[0].text
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
        streamed = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain.choices[0].text
    finally:
        standalone.stop()


def test_http_connections_send_without_nagle_delay(server):
    import socket

    # asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP (accepted ones inherit the
    # listener's); without it a keep-alive client waited 40 ms (its delayed ACK) for each reply's body.
    listeners = [s for http_server in server.server._http.servers for s in http_server.sockets]
    assert listeners and all(s.proto == socket.IPPROTO_TCP for s in listeners)


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(client, server):
    prompt = random_prompts(1, 40, seed=54)[0]  # two full blocks of 16, and a part of one
    first = client.completions.create(model="target", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model="target", prompt=prompt, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].text == first.choices[0].text
    chunks = client.completions.create(
        model="target", prompt=prompt, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == 32
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    hits = [line for line in text.splitlines() if line.startswith('cascade:prefix_cache_hits_total{tier="target"}')]
    assert hits and float(hits[0].split()[-1]) >= 64
    for name in ("prefix_cache_queries_total", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_free"):
        assert f'cascade:{name}{{tier="close"}}' in text, name


def test_speculation_per_request_keeps_the_text_and_off_drafts_nothing(client):
    texts, stats = {}, {}
    for mode in ("auto", "fixed", "off"):
        reply = client.completions.create(
            model="target", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"speculation": {"mode": mode}}
        )
        texts[mode], stats[mode] = reply.choices[0].text, reply.model_extra["cascade"]
    assert texts["auto"] == texts["fixed"] == texts["off"]
    assert stats["off"]["target_calls"] == N and not stats["off"].get("drafted_by_position")  # one token a pass
    assert stats["fixed"]["target_calls"] < N and sum(stats["fixed"]["drafted_by_position"]) > 0


def test_top_k_rides_as_an_extra_field(client, tiny_family):
    greedy = client.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0)
    top1 = client.completions.create(
        model="target", prompt=PROMPT, max_tokens=N, temperature=1.0, seed=3, extra_body={"top_k": 1}
    )
    assert top1.choices[0].text == greedy.choices[0].text


def test_logit_bias_moves_the_greedy_text_as_transformers_does(server, client, tiny_family):
    from cascade_service.client import CascadeClient

    plain = oracle(tiny_family["target"], PROMPT, N)
    bias = {plain[0]: -100.0, 7: 3.0}
    expected = oracle(tiny_family["target"], PROMPT, N, logit_bias=bias)
    assert expected != plain
    reply = client.completions.create(
        model="target", prompt=PROMPT, max_tokens=N, temperature=0, logit_bias={str(t): b for t, b in bias.items()}
    )
    with CascadeClient(f"127.0.0.1:{server.port}", api_key=KEY_A) as grpc_client:
        direct = grpc_client.generate(prompt_token_ids=PROMPT, max_new_tokens=N, logit_bias=bias)
    assert list(direct.token_ids) == expected and reply.choices[0].text == direct.text


def test_a_predicted_output_gives_the_same_text_and_openais_usage_details(client):
    plain = client.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0)
    text = plain.choices[0].text
    for content in (
        text,
        [{"type": "text", "text": text[: len(text) // 2]}, {"type": "text", "text": text[len(text) // 2 :]}],
    ):
        reply = client.completions.create(
            model="target",
            prompt=PROMPT,
            max_tokens=N,
            temperature=0,
            extra_body={"prediction": {"type": "content", "content": content}},
        )
        assert reply.choices[0].text == text
        # The tiny family's byte-level tokenizer does not give the output's ids back from its (lossy) text,
        # so the prediction drafts without being kept much; the demo family's does (docs/benchmarks.md).
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0, details
    none = plain.usage.completion_tokens_details
    assert none.accepted_prediction_tokens == none.rejected_prediction_tokens == 0


def test_openais_penalties_move_the_greedy_text_as_their_definition_says(server, client, tiny_family):
    from cascade_service.client import CascadeClient

    expected = oracle(tiny_family["target"], PROMPT, N, penalties=(1.0, 1.5))
    assert expected != oracle(tiny_family["target"], PROMPT, N)
    reply = client.completions.create(
        model="target", prompt=PROMPT, max_tokens=N, temperature=0, presence_penalty=1.0, frequency_penalty=1.5
    )
    with CascadeClient(f"127.0.0.1:{server.port}", api_key=KEY_A) as grpc_client:
        direct = grpc_client.generate(
            prompt_token_ids=PROMPT, max_new_tokens=N, presence_penalty=1.0, frequency_penalty=1.5
        )
    assert list(direct.token_ids) == expected and reply.choices[0].text == direct.text


def test_logprobs_in_openais_completions_shape_unary_and_streamed(server, client):
    from cascade_service.client import CascadeClient

    with CascadeClient(f"127.0.0.1:{server.port}", api_key=KEY_A) as grpc_client:
        direct = grpc_client.generate(prompt_token_ids=PROMPT, max_new_tokens=N, logprobs=2)
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert lp.tokens == [t["text"] for t in direct.logprobs]
    assert lp.token_logprobs == pytest.approx([t["logprob"] for t in direct.logprobs], abs=LOGPROB_TOLERANCE)
    assert [len(top) for top in lp.top_logprobs] == [2] * N or all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == reply.choices[0].text
    streamed = client.completions.create(
        model="target", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2, stream=True
    )
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    assert [t for p in pieces for t in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=LOGPROB_TOLERANCE)
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset


def test_a_json_schema_response_format_gives_json_of_the_schema(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    reply = client.completions.create(
        model="target",
        prompt=PROMPT,
        max_tokens=32,
        temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}},
    )
    value = json.loads(reply.choices[0].text)
    assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3) and reply.choices[0].finish_reason == "stop"
    assert not any(c.isspace() for c in reply.choices[0].text), reply.choices[0].text  # compact by default


def test_a_body_past_the_message_limit_is_a_413_naming_it_and_a_big_prompt_within_it_a_400(server):
    # The HTTP API holds a body to the gRPC API's message limit (serving.admission.max_message_bytes), read
    # as it arrives; within it, a prompt past what the model holds is refused naming `prompt`, as gRPC does.
    head = b'{"model": "target", "max_tokens": 4, "prompt": "'
    code, reply = _post(server, "/v1/completions", head + b"x" * (MAX_REQUEST_BYTES + 1) + b'"}')
    assert code == 413, reply
    assert reply["error"]["message"] == (
        f"request too large: more than the limit of {MAX_REQUEST_BYTES} bytes (serving.admission.max_message_bytes)"
    )
    code, reply = _post(server, "/v1/completions", head + b"x" * 4_000_000 + b'"}')
    assert code == 400 and reply["error"]["param"] == "prompt", reply
    code, reply = _post(server, "/v1/completions", {"model": "target", "prompt": PROMPT, "max_tokens": 2})
    assert code == 200 and reply["choices"][0]["text"] is not None  # still serving
