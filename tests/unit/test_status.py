"""The rich error details (api/status.py): the field each message names, RetryInfo by code, and the
SDK reading them back from a call's trailer."""

from __future__ import annotations

import pickle

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from cascade_service.api.backend import RecordingContext
from cascade_service.api.servicer import _require_id, _verification, status_for
from cascade_service.api.status import (
    DETAILS_KEY,
    RETRY_DELAY_S,
    abort,
    field_of,
    rich_status,
    set_status,
    too_large,
)
from cascade_service.client import errors, sync
from cascade_service.core.verify import Verification
from cascade_service.intake import with_stop_threshold
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.sessions.store import (
    MAX_SESSION_TOKENS,
    check_session_id,
    check_token_ids,
)

# Messages the server sends, as the code writes them, and the field each names.
MESSAGES = [
    ("prompt: 40000 tokens, more than the limit of 2047 (the model holds 2048 positions)", "prompt"),
    ("prompt: give prompt or prompt_token_ids, not both", "prompt"),
    ("prompt: empty (give prompt, prompt_token_ids or a session_id with history)", "prompt"),
    ("prompt: empty (the session has no history yet)", "prompt"),
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
    (
        "stop_threshold: no tier of this cascade has an acceptance head (schedule.adaptive with rule specdec)",
        "stop_threshold",
    ),
    ("verification.alpha must be a number, got 'x'", "verification.alpha"),
    ("verification.beta must be a finite number >= 1 - alpha = 0.5, got 0.1", "verification.beta"),
    ("session_id must match [A-Za-z0-9][A-Za-z0-9_.:-]{0,127}, got '!'", "session_id"),
    ("session_id: required", "session_id"),
    # Not a field: no BadRequest rather than a wrong one.
    ("token ids must be in [0, 2**31), got -1", None),
    ("token ids must be ints, got True", None),
    ("token_ids must be a sequence of ints, got str", None),  # a field of Session, not of a request
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


# The raising code itself, where it runs without a model: a reworded message that loses its field
# fails here, not only in the integration tests. (The coordinator's own checks need a model: those
# run in tests/integration/test_api.py and test_api_fuzz.py.)
RAISED = [
    (lambda: Verification("telepathy"), "verification.rule"),
    (lambda: Verification("chow", 2.0), "verification.alpha"),
    (lambda: Verification("chow", float("nan")), "verification.alpha"),
    (lambda: Verification("lossy", 0.5, 0.1), "verification.beta"),
    (
        lambda: _verification(pb.GenerateRequest(verification=pb.Verification(rule="lossy", beta=1.0, tune_beta=True))),
        "verification.beta",
    ),
    (lambda: _verification(pb.GenerateRequest(verification=pb.Verification(rule="telepathy"))), "verification.rule"),
    (lambda: _require_id(""), "session_id"),
    (lambda: check_session_id("bad id!"), "session_id"),
    (lambda: with_stop_threshold({}, 1.5), "stop_threshold"),
    (lambda: with_stop_threshold({}, 0.5), "stop_threshold"),
    # The session store's own checks name no request field: no BadRequest rather than a guessed one.
    (lambda: check_token_ids([-1]), None),
    (lambda: check_token_ids([1.5]), None),
    (lambda: check_token_ids(range(MAX_SESSION_TOKENS + 1)), None),
]


@pytest.mark.parametrize(("raise_it", "field"), RAISED)
def test_the_field_of_each_message_the_code_raises(raise_it, field):
    with pytest.raises(ValueError) as caught:
        raise_it()
    code, message = status_for(caught.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    bad = error_details_pb2.BadRequest()
    found = [v.field for d in rich_status(code, message).details if d.Unpack(bad) for v in bad.field_violations]
    assert found == ([field] if field else [])


def test_set_status_on_a_recording_context():
    # The coordinator deployment behind the edge serves through a RecordingContext; the edge rebuilds
    # the trailer from code and message, so the context keeps those two and takes the trailer quietly.
    context = RecordingContext()
    set_status(context, grpc.StatusCode.INVALID_ARGUMENT, "session_id: required")
    assert (context.code, context.details) == (grpc.StatusCode.INVALID_ARGUMENT, "session_id: required")


def test_abort_ends_the_call_with_the_same_status_as_to_status():
    class Context:
        def abort_with_status(self, status):
            self.status = status
            raise RuntimeError("aborted")

    context = Context()
    with pytest.raises(RuntimeError, match="aborted"):
        abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "tier 'mid' is at its queue limit; retry later")
    expected = rpc_status.to_status(
        rich_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "tier 'mid' is at its queue limit; retry later")
    )
    assert (context.status.code, context.status.details) == (expected.code, expected.details)
    assert context.status.trailing_metadata == expected.trailing_metadata


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


def test_a_request_too_large_to_serve_gets_no_retry_hint():
    # RESOURCE_EXHAUSTED for a full queue says when to retry; for a request past the message limit the
    # same request can never succeed, so its status carries no RetryInfo (as gRPC's own refusal).
    status = rich_status(grpc.StatusCode.RESOURCE_EXHAUSTED, too_large(6_000_000, 5_065_536))
    assert status.message == (
        "request too large: 6000000 bytes, more than the limit of 5065536 bytes (serving.admission.max_message_bytes)"
    )
    assert not any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
    full = rich_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "the coordinator is at its queue limit; retry later")
    assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in full.details)


def test_the_edge_answers_a_message_its_transport_refuses_for_size_without_a_retry_hint():
    from cascade_service.api.blocking import transport_failure

    refused = _Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5000123 vs. 4194304)", ())
    code, message, _ = transport_failure(refused)
    assert code == "RESOURCE_EXHAUSTED" and message.startswith("request too large: ") and "4194304" in message
    code, message, _ = transport_failure(_Failed(grpc.StatusCode.UNAVAILABLE, "connection reset", ()))
    assert (code, message) == ("UNAVAILABLE", "coordinator unavailable (_Failed); retry")
    assert transport_failure(RuntimeError("actor died"))[0] == "UNAVAILABLE"


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
    error = errors.from_rpc_error(
        _Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", ((DETAILS_KEY, busy.SerializeToString()),))
    )
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
    assert (
        sync.retry_delay_s(
            _Failed(grpc.StatusCode.UNAVAILABLE, "x", ((DETAILS_KEY, status.SerializeToString()),)), 0.05, None
        )
        == sync.MAX_RETRY_DELAY_S
    )


class _ProxyContext:
    """What Ray's proxy hands to RayServegRPCContext: grpc.aio's servicer context, its request_id set."""

    def __init__(self) -> None:
        self.set, self.trailing = {}, [("request_id", "r-1")]

    def auth_context(self):
        return {}

    def invocation_metadata(self):
        return ()

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def peer_identities(self):
        return None

    def peer_identity_key(self):
        return None

    def trailing_metadata(self):
        return self.trailing

    def set_trailing_metadata(self, metadata):
        self.trailing = list(metadata)

    def code(self):
        return self.set.get("code")

    def details(self):
        return self.set.get("details", "")

    def set_code(self, code):
        self.set["code"] = code

    def set_details(self, details):
        self.set["details"] = details


def test_a_servicer_failing_on_ray_serves_context_sets_the_trailer_the_proxy_forwards():
    from ray.serve.grpc_util import RayServegRPCContext

    from cascade_service.api.servicer import fail

    replica = RayServegRPCContext(_ProxyContext())
    message = "max_new_tokens must be in [1, 4096], got 0"
    # The servicer reports and returns (a raise would end the call through Ray's error path instead).
    assert fail(replica, ValueError(message), "empty") == "empty"
    proxy = _ProxyContext()
    replica._set_on_grpc_context(proxy)  # what Ray's proxy does with the replica's context of a unary call
    details = rich_status(grpc.StatusCode.INVALID_ARGUMENT, message).SerializeToString()
    assert (proxy.code(), proxy.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert proxy.trailing == [("request_id", "r-1"), (DETAILS_KEY, details)]
