"""Bad requests every front end must refuse, and reading a refusal's rich status trailer."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

from cascade_service.api.status import DETAILS_KEY
from cascade_service.proto.v1 import cascade_pb2 as pb

# (request, field, message), on the wire: the trailer as any gRPC client in any language reads it.
BAD_REQUESTS = [
    (pb.GenerateRequest(prompt="x", max_new_tokens=0), "max_new_tokens", "max_new_tokens must be in [1, 4096], got 0"),
    (pb.GenerateRequest(prompt="x", temperature=-1), "temperature", "temperature must be in [0, 100], got -1.0"),
    (
        pb.GenerateRequest(prompt="x", prompt_token_ids=[1]),
        "prompt",
        "prompt: give prompt or prompt_token_ids, not both",
    ),
    (
        pb.GenerateRequest(prompt="x", verification=pb.Verification(rule="lossy", beta=1.0, tune_beta=True)),
        "verification.beta",
        "verification.beta: give beta or tune_beta, not both",
    ),
    (
        pb.GenerateRequest(prompt="x", speculation=pb.Speculation(mode="sometimes")),
        "speculation.mode",
        "speculation.mode must be one of auto, fixed, off, got 'sometimes'",
    ),
    (pb.GenerateRequest(prompt="x", top_k=1 << 21), "top_k", "top_k must be in [0, 1048576] (0: off), got 2097152"),
]


def status_details(error: grpc.RpcError) -> status_pb2.Status:
    raw = [value for key, value in error.trailing_metadata() or () if key == DETAILS_KEY]
    assert len(raw) == 1, error.trailing_metadata()
    return status_pb2.Status.FromString(raw[0])


def field_violations(status: status_pb2.Status) -> list[str]:
    bad = error_details_pb2.BadRequest()
    return [v.field for d in status.details if d.Unpack(bad) for v in bad.field_violations]
