"""Property-based bad input (hypothesis): random and malformed GenerateRequests over real gRPC.

Every answer is either a valid result (token ids inside the vocabulary, no more than the request's
budget) or INVALID_ARGUMENT / NOT_FOUND with a message naming a request field, whose rich error
details trailer has the same code and message and, for INVALID_ARGUMENT, a FieldViolation for the
field the message begins with; never INTERNAL, UNKNOWN or a hang. Afterwards the server still gives the oracle's output.
"""

from __future__ import annotations

import math

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cascade_service.api.server import start_server
from cascade_service.api.status import DETAILS_KEY
from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.core.verify import RULES
from cascade_service.inprocess import InProcess
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc as pb_grpc
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle

FIELDS = (
    "prompt",
    "prompt_token_ids",
    "session_id",
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "verification.rule",
    "verification.alpha",
    "verification.beta",
)
DEFAULT_BUDGET = 8
VOCAB = 320  # the tiny family's vocabulary


@pytest.fixture(scope="module")
def stub(tiny_family):
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
    )
    engine = InProcess(cascade)
    assert engine.target.vocab_size == VOCAB
    from cascade_service.sessions import MemoryStore

    server, port = start_server(engine.coordinator(MemoryStore(), GenerationConfig(max_new_tokens=DEFAULT_BUDGET)))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.CascadeServiceStub(channel)
    channel.close()
    server.stop(0)


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0, -1.0]))
requests = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text(max_size=40),
        "prompt_token_ids": st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(0, VOCAB - 1), max_size=12),
        "session_id": st.text(max_size=12) | st.sampled_from(["no-such-session", "ok_id-1"]),
        "max_new_tokens": st.integers(-(2**31), 2**31 - 1) | st.integers(1, 12),
        "temperature": floats,
        "top_p": floats,
        "seed": st.integers(0, 2**64 - 1),
        "stop": st.lists(st.text(max_size=6), max_size=3),
        "verification": st.fixed_dictionaries(
            {"rule": st.sampled_from(RULES) | st.text(max_size=8)},
            optional={"alpha": floats, "beta": floats, "tune_beta": st.booleans()},
        ),
    },
)


# Mostly well-formed requests: these decode, so the outputs' checks run too.
valid_source = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=30)}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)}),
)
plausible = st.tuples(
    valid_source,
    st.fixed_dictionaries(
        {},
        optional={
            "max_new_tokens": st.integers(1, 12),
            "temperature": st.floats(0.0, 2.0),
            "top_p": st.floats(0.05, 1.0),
            "seed": st.integers(0, 2**63 - 1),
            "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
            "verification": st.fixed_dictionaries(
                {"rule": st.sampled_from(RULES)}, optional={"alpha": st.floats(-1.0, 0.95)}
            ),
        },
    ),
).map(lambda pair: {**pair[0], **pair[1]})
OUTCOMES: dict[str, int] = {}


def _budget(fields: dict) -> int:
    return fields.get("max_new_tokens", DEFAULT_BUDGET)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=requests)
def test_random_requests_get_a_result_or_a_clear_error(stub, fields):
    _check(stub, fields)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=plausible)
def test_plausible_requests_decode_or_name_the_bad_knob(stub, fields):
    _check(stub, fields)


def test_the_plausible_requests_mostly_decoded():
    # The property above is only worth something if most of its requests got through validation.
    assert OUTCOMES.get("decoded", 0) >= 60, OUTCOMES


def _check(stub, fields: dict) -> None:
    fields = dict(fields)
    verification = fields.pop("verification", None)
    request = pb.GenerateRequest(**fields)
    if verification is not None:
        request.verification.CopyFrom(pb.Verification(**verification))
    for call in ("unary", "stream"):
        try:
            if call == "unary":
                reply = stub.Generate(request, timeout=60)
                tokens = list(reply.token_ids)
            else:
                tokens = [t for chunk in stub.GenerateStream(request, timeout=60) for t in chunk.token_ids]
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (
                err.code(),
                err.details(),
                fields,
            )
            assert any(name in err.details() for name in FIELDS), (err.details(), fields)
            _check_details(err)
            outcome = f"{err.code().name}: {err.details().split(' ')[0].rstrip(':')}"
            event(outcome)
            OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1
            continue
        event("decoded")
        OUTCOMES["decoded"] = OUTCOMES.get("decoded", 0) + 1
        assert all(0 <= t < VOCAB for t in tokens)
        assert len(tokens) <= _budget(fields)
        temperature = fields.get("temperature", 0.0)
        assert not math.isnan(temperature)  # a NaN knob never decodes


def _check_details(err: grpc.RpcError) -> None:
    raw = [value for key, value in err.trailing_metadata() or () if key == DETAILS_KEY]
    assert len(raw) == 1, (err.details(), err.trailing_metadata())
    status = status_pb2.Status.FromString(raw[0])
    assert (status.code, status.message) == (err.code().value[0], err.details())
    bad = error_details_pb2.BadRequest()
    violations = [(v.field, v.description) for d in status.details if d.Unpack(bad) for v in bad.field_violations]
    if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
        assert len(violations) == 1 and violations[0][1] == err.details(), (err.details(), violations)
        field = violations[0][0]
        assert field in FIELDS and err.details().startswith(field), (err.details(), field)
    else:
        assert violations == [], (err.details(), violations)


def test_the_server_still_answers_correctly_afterwards(tiny_family, stub):
    prompt = random_prompts(1, 10, seed=77)[0]
    reply = stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=12), timeout=60)
    assert list(reply.token_ids) == oracle(tiny_family["target"], prompt, 12)
