"""The rich error details (api/status.py): the field each message names, RetryInfo by code, and the
SDK reading them back from a call's trailer."""

from __future__ import annotations

import pickle

import grpc
import pytest
from google.rpc import error_details_pb2

from cascade_service.api.status import DETAILS_KEY, RETRY_DELAY_S, field_of, rich_status
from cascade_service.client import errors, sync

# Messages the server sends, as the code writes them, and the field each names.
MESSAGES = [
    ("prompt: 40000 tokens, more than the limit 32768", "prompt"),
    ("prompt: give prompt or prompt_token_ids, not both", "prompt"),
    ("max_new_tokens must be in [1, 4096], got 0", "max_new_tokens"),
    ("temperature must be in [0, 100], got -1.0", "temperature"),
    ("top_p must be in (0, 1], got 0.0", "top_p"),
    ("seed must be in [0, 2**63), got 9223372036854775808", "seed"),
    ("stop: at most 16 non-empty strings of at most 256 characters", "stop"),
    ("prompt_token_ids: [99999] is outside the vocabulary [0, 512)", "prompt_token_ids"),
    ("verification.beta: give beta or tune_beta, not both", "verification.beta"),
    ("verification.rule must be one of exact, lossy; got 'x'", "verification.rule"),
    ("verification.alpha for rule 'chow' must be in [-1, 1], got 2.0", "verification.alpha"),
    ("stop_threshold must be in (0, 1), got 1.5", "stop_threshold"),
    ("session_id must match [A-Za-z0-9][A-Za-z0-9_.:-]{0,127}, got '!'", "session_id"),
    ("session_id: required", "session_id"),
    # Not a field: no BadRequest rather than a wrong one.
    ("token ids must be in [0, 2**31), got -1", None),
    ("a session holds at most 1000000 tokens, got 1000001", None),
    ("verification.nonsense: x", None),
    ("prompts: x", None),
]


@pytest.mark.parametrize(("message", "field"), MESSAGES)
def test_the_field_an_error_message_names(message, field):
    assert field_of(message) == field
    status = rich_status(grpc.StatusCode.INVALID_ARGUMENT, message)
    assert (status.code, status.message) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], message)
    bad = error_details_pb2.BadRequest()
    found = [v.field for d in status.details if d.Unpack(bad) for v in bad.field_violations]
    assert found == ([field] if field else [])


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_retry_info_exactly_for_resource_exhausted_and_unavailable(code):
    status = rich_status(code, "max_new_tokens must be in [1, 4096], got 0")
    retry = error_details_pb2.RetryInfo()
    delays = [retry.retry_delay.ToNanoseconds() for d in status.details if d.Unpack(retry)]
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        assert len(delays) == 1 and delays[0] > 0
    else:
        assert delays == []
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details) == (code == grpc.StatusCode.INVALID_ARGUMENT)


class _Failed(grpc.RpcError):
    def __init__(self, code, message, trailing):
        self._code, self._message, self._trailing = code, message, trailing

    def code(self):
        return self._code

    def details(self):
        return self._message

    def trailing_metadata(self):
        return self._trailing


def test_the_sdk_reads_field_violations_and_retry_delay_and_survives_a_bad_trailer():
    message = "verification.beta: give beta or tune_beta, not both"
    trailer = ((DETAILS_KEY, rich_status(grpc.StatusCode.INVALID_ARGUMENT, message).SerializeToString()),)
    error = errors.from_rpc_error(_Failed(grpc.StatusCode.INVALID_ARGUMENT, message, trailer))
    assert isinstance(error, errors.InvalidArgument) and error.details == message
    assert error.field_violations == (errors.FieldViolation("verification.beta", message),)
    assert error.retry_delay_s is None
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.field_violations, again.details) == (type(error), error.field_violations, message)
    busy = rich_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "the coordinator is at its queue limit; retry later")
    error = errors.from_rpc_error(_Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", ((DETAILS_KEY, busy.SerializeToString()),)))
    assert error.retry_delay_s == pytest.approx(1.0) and error.field_violations == ()
    for trailing in ((), None, ((DETAILS_KEY, b"\xff not a status"),)):
        error = errors.from_rpc_error(_Failed(grpc.StatusCode.INVALID_ARGUMENT, "x", trailing))
        assert (error.field_violations, error.retry_delay_s) == ((), None)


def test_the_sdk_sleeps_as_retry_info_says_within_its_bounds():
    unavailable = rich_status(grpc.StatusCode.UNAVAILABLE, "the store is restarting").SerializeToString()
    hinted = _Failed(grpc.StatusCode.UNAVAILABLE, "x", ((DETAILS_KEY, unavailable),))
    assert sync.retry_delay_s(hinted, 0.05, None) == pytest.approx(RETRY_DELAY_S[grpc.StatusCode.UNAVAILABLE])
    assert sync.retry_delay_s(hinted, 0.05, 0.5) == 0.5  # never longer than one try's timeout
    assert sync.retry_delay_s(_Failed(grpc.StatusCode.UNAVAILABLE, "x", ()), 0.05, None) == 0.05  # no hint
    far = error_details_pb2.RetryInfo()
    far.retry_delay.FromSeconds(3600)
    status = rich_status(grpc.StatusCode.UNAVAILABLE, "x")
    del status.details[:]
    status.details.add().Pack(far)
    assert sync.retry_delay_s(_Failed(grpc.StatusCode.UNAVAILABLE, "x", ((DETAILS_KEY, status.SerializeToString()),)),
                              0.05, None) == sync.MAX_RETRY_DELAY_S
