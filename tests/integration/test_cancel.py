"""A client that cancels or runs out of time stops the decode (issue 6), on the standalone gRPC server.

The coordinator asks the server's context whether the caller is still there after every target round.
A slowed target (20 ms a forward pass) makes a full decode take far longer than the test waits, so the
checks tell "stopped at the cancel" from "ran to max_new_tokens": the request's scorers (its KV caches)
are released within a few rounds of the cancel, having done a small share of the work, and a session
used by the cancelled request is left exactly as it was.
"""

from __future__ import annotations

import time

import grpc
import pytest

from cascade_service.api.server import start_server
from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.inprocess import InProcess
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc as pb_grpc
from cascade_service.sessions import MemoryStore
from cascade_service.zoo.tiny import random_prompts

from ..helpers.slow import Requests

PROMPT = random_prompts(1, 10, seed=5)[0]
LONG = 4000  # within the 4,096 positions; a full decode: >= 4096 / 5 target passes of >= 20 ms each, over 16 s


@pytest.fixture()
def served(tiny_family):
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
    )
    coordinator = InProcess(cascade).coordinator(MemoryStore(), GenerationConfig(max_new_tokens=16))
    requests = Requests(coordinator)
    server, port = start_server(coordinator)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.CascadeServiceStub(channel), requests
    channel.close()
    server.stop(0)


def _stopped_soon(requests: Requests, cancelled_at: float) -> int:
    assert requests.done.wait(5.0), "the decode was still running 5 s after the cancel"
    released_at, passes = requests.released[-1]
    assert released_at - cancelled_at < 1.0
    assert passes < LONG / 10, passes  # a small share of a full decode's passes
    time.sleep(0.3)
    assert requests.targets[-1].passes == passes  # and no work after the release
    return passes


@pytest.mark.parametrize("how", ["deadline", "unary-cancel", "stream-cancel"])
def test_a_cancel_or_deadline_stops_the_decode_and_releases_its_caches(served, how):
    stub, requests = served
    session = stub.CreateSession(pb.CreateSessionRequest(prompt_token_ids=PROMPT))
    request = pb.GenerateRequest(session_id=session.session_id, max_new_tokens=LONG)
    if how == "deadline":
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    elif how == "unary-cancel":
        call = stub.Generate.future(request)
        time.sleep(0.5)
        assert call.cancel()
    else:
        stream = stub.GenerateStream(request)
        assert next(stream).token_ids
        stream.cancel()
    passes = _stopped_soon(requests, time.monotonic())
    print(f"{how}: released after {passes} target passes")
    # It had started: a stream's first chunk comes after one target pass, and the front end may see
    # the cancel before a second one.
    assert passes >= (1 if how == "stream-cancel" else 2)
    after = stub.GetSession(pb.GetSessionRequest(session_id=session.session_id))
    assert list(after.token_ids) == PROMPT and after.version == session.version  # untouched
    # the server goes on serving, and the session with it
    reply = stub.Generate(pb.GenerateRequest(session_id=session.session_id, max_new_tokens=4), timeout=30)
    assert len(reply.token_ids) == 4 and reply.session_length == len(PROMPT) + 4
