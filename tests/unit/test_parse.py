"""api.parse: bytes that are no message name the field at fault, walked over the wire format."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cascade_service.api.admission import Limits, limits_from
from cascade_service.api.parse import blame, decode
from cascade_service.config import ConfigError, parse_config
from cascade_service.proto.v1 import cascade_pb2 as pb


def test_a_valid_message_decodes_and_has_no_fault():
    request = pb.GenerateRequest(
        prompt="héllo",
        prompt_token_ids=[1, 300, 70000],
        stop=["\n"],
        verification=pb.Verification(rule="lossy", alpha=0.5),
    )
    data = request.SerializeToString()
    assert decode(pb.GenerateRequest, data) == request
    assert blame(pb.GenerateRequest.DESCRIPTOR, data) is None


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x0a\x02\xc3\x28", "prompt: not a valid cascade.v1.GenerateRequest (not UTF-8)"),
        (b"\x42\x01\xff", "stop: not a valid cascade.v1.GenerateRequest (not UTF-8)"),
        (b"\x4a\x04\x0a\x02\xff\xfe", "verification.rule: not a valid cascade.v1.GenerateRequest (not UTF-8)"),
        (
            b"\x4a\x05\x0a\x02",
            ("verification: not a valid cascade.v1.GenerateRequest (its length runs past the end of the message)"),
        ),
        (b"\x12\x02\x05\x86", "prompt_token_ids: not a valid cascade.v1.GenerateRequest (a truncated number)"),
        (
            b"\x1a\x09abc",
            "session_id: not a valid cascade.v1.GenerateRequest (its length runs past the end of the message)",
        ),
        (b"\x20\xff", "max_new_tokens: not a valid cascade.v1.GenerateRequest (a truncated number)"),
        (b"\x80", "request: not a valid cascade.v1.GenerateRequest (a truncated field tag)"),
        (
            b"\xfa\x01\x05ab",
            "request: not a valid cascade.v1.GenerateRequest (its length runs past the end of the message)",
        ),
    ],
)
def test_the_field_at_fault_is_named(data, message):
    with pytest.raises(ValueError) as caught:
        decode(pb.GenerateRequest, data)
    assert str(caught.value) == message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_a_one_line_value_error(data):
    try:
        decode(pb.GenerateRequest, data)
    except ValueError as exc:
        text = str(exc)
        assert "\n" not in text and ": not a valid cascade.v1.GenerateRequest" in text


def test_admission_settings_in_the_config_reach_the_limits():
    raw = {
        "tiers": {"target": {"name": "t", "path": "/x"}, "drafters": []},
        "serving": {"admission": {"max_pending": 10, "body_timeout_s": 2}},
    }
    admission = parse_config(raw).serving.admission
    assert limits_from(admission, workers=3) == Limits(workers=3, max_pending=10, body_timeout_s=2.0)
    for bad, message in (
        ({"max_pendng": 1}, "unknown field serving.admission.max_pendng"),
        ({"workers": "8"}, "serving.admission.workers must be a number"),
        ({"workers": 1.5}, "serving.admission.workers must be a whole number"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_config({**raw, "serving": {"admission": bad}})
    with pytest.raises(ValueError, match=r"serving.admission.body_timeout_s must be in \(0, 3600\]"):
        limits_from({"body_timeout_s": 0.0})
