"""A request is built once (issue 47). On the standalone server a unary Generate's body is parsed once
and its settings checked once, and it decodes with no front-end thread waiting on it (the front end
awaits the engine loop on its own event loop); the HTTP API hands the engine the message it built,
never bytes; in process, `InProcess.generate` checks once too; the Ray edge parses what it forwards once
and sends the client's bytes on as they came.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import pytest

from cascade_service import coordinator, intake
from cascade_service.api.servicer import CascadeServicer
from cascade_service.client import CascadeClient
from cascade_service.config import Config, GenerationConfig
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc
from cascade_service.standalone import start_standalone
from cascade_service.zoo.tiny import random_prompts

from ..helpers.tier_servers import tiny_cascade

PROMPT = random_prompts(1, 10, seed=47)[0]
N = 12
API = str(Path(coordinator.__file__).parent / "api")  # the front end's code
CHECKS = ("check_generation", "request_schedule", "with_stop_threshold")
FRONT_END_LOOP = "cascade-frontend"  # the thread of the front end's event loop (api.frontend_server)


@pytest.fixture(scope="module")
def served(tiny_family):
    standalone = start_standalone(Config(tiny_cascade(tiny_family), GenerationConfig(max_new_tokens=N)), http_port=0)
    yield standalone
    standalone.stop()


def _grpc_generate(served) -> pb.GenerateResponse:
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        stub = cascade_pb2_grpc.CascadeServiceStub(channel)
        return stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=N), timeout=60)


def _http_generate(served) -> dict:
    body = json.dumps({"model": "target", "prompt": PROMPT, "max_tokens": N}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.http_port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def _front_end_threads(own: int) -> list[str]:
    """The threads other than `own` that are inside the front end's code now, blocked there: the front
    end's event loop itself may be running its coroutines (never blocked: health answers on it)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    inside = []
    for ident, frame in sys._current_frames().items():
        while frame is not None and ident != own and names.get(ident) != FRONT_END_LOOP:
            if frame.f_code.co_filename.startswith(API):
                inside.append(names.get(ident, str(ident)))
                break
            frame = frame.f_back
    return inside


def test_a_unary_generate_decodes_with_no_front_end_thread_waiting_on_it(served, monkeypatch):
    # The old front end handed each call to a worker thread of its pool, which sat in
    # LocalBackend.call for the whole decode; now the front end's coroutine awaits the engine loop.
    seen = []
    original = CascadeServicer.Generate

    def generate(self, request, context, cancelled=None):
        seen.append((threading.current_thread().name, _front_end_threads(threading.get_ident())))
        return original(self, request, context, cancelled)

    monkeypatch.setattr(CascadeServicer, "Generate", generate)
    reply = _grpc_generate(served)
    completion = _http_generate(served)
    loop = served.coordinator.loop.name
    assert seen == [(loop, []), (loop, [])]  # in the engine loop's thread, no front-end thread blocked
    assert len(reply.token_ids) == N and completion["choices"][0]["text"] == reply.text


def _count(monkeypatch, kind, name: str, counts: Counter) -> None:
    original = getattr(kind, name)
    if name == "FromString":

        def counted(data, _original=original):
            counts[f"{kind.__name__}.{name}"] += 1
            return _original(data)

        monkeypatch.setattr(kind, name, staticmethod(counted))
    else:

        def counted_method(self, *args, _original=original, **kwargs):
            counts[f"{kind.__name__}.{name}"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(kind, name, counted_method)


@pytest.fixture
def parses(monkeypatch) -> Counter:
    """Calls of each request and reply message's parse and serialization in this process."""
    counts: Counter = Counter()
    for kind in (pb.GenerateRequest, pb.GenerateResponse):
        for name in ("FromString", "SerializeToString"):
            _count(monkeypatch, kind, name, counts)
    return counts


def test_a_grpc_body_is_parsed_once_and_the_http_api_hands_over_its_message(served, parses):
    _grpc_generate(served)
    assert parses["GenerateRequest.FromString"] == 1  # the front end's decode, and no other
    parses.clear()
    _http_generate(served)
    # Within one process: the message the HTTP body became reaches the servicer, its reply comes back
    assert not +parses, parses


@pytest.fixture
def checks(monkeypatch) -> Counter:
    """Calls of each request check, wherever a module calls it from."""
    counts: Counter = Counter()
    for module in (intake, coordinator):
        for name in CHECKS:
            original = getattr(module, name, None)
            if original is None:
                continue

            def counted(*args, _name=name, _original=original, **kwargs):
                counts[_name] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)
    return counts


def test_each_check_runs_once_per_request_served_or_in_process(served, checks):
    _grpc_generate(served)
    assert checks == Counter(dict.fromkeys(CHECKS, 1))
    checks.clear()
    with CascadeClient(f"127.0.0.1:{served.port}", timeout_s=60) as client:
        assert list(client.stream(prompt_token_ids=PROMPT, max_new_tokens=N))
    assert checks == Counter(dict.fromkeys(CHECKS, 1))
    checks.clear()
    _http_generate(served)
    assert checks == Counter(dict.fromkeys(CHECKS, 1))
    checks.clear()
    generation = served.engine.generate(PROMPT, GenerationConfig(max_new_tokens=N))
    assert checks == Counter(dict.fromkeys(CHECKS, 1))
    assert len(generation.token_ids) == N


class _FakeDeployment:
    """Plays a Ray Serve handle to the coordinator deployment: records the bytes the edge sends and
    answers as the replica does, with a reply's bytes."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.rpc = self

    def options(self, **_: object) -> _FakeDeployment:
        return self

    def remote(self, method: str, body: bytes, owner: str) -> _FakeDeployment:
        self.sent.append(body)
        return self

    def cancel(self) -> None:
        pass

    def result(self, timeout_s: float | None = None) -> tuple[str, str, bytes]:
        return "OK", "", pb.GenerateResponse(text="forwarded").SerializeToString()


def test_the_ray_edge_parses_once_and_forwards_the_clients_bytes(parses):
    from cascade_service.api.edge import start_edge
    from cascade_service.serving.local import HandleBackend

    deployment = _FakeDeployment()
    server, port, _ = start_edge(HandleBackend(deployment), workers=2)
    try:
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, session_id="", max_new_tokens=N)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            server.set_serving(True)
            reply = cascade_pb2_grpc.CascadeServiceStub(channel).Generate(request, timeout=30)
    finally:
        server.stop(0)
    assert reply.text == "forwarded"
    assert deployment.sent == [request.SerializeToString()]  # as the client sent them: not made again
    # One parse here (the front end's: admission and the routing key); the replica parses its own copy.
    assert parses["GenerateRequest.FromString"] == 1


def test_a_requests_fields_take_one_conversion_and_the_intake_is_built_once(served):
    # Issue 59 point 8: protobuf -> intake.Asked in the servicer (one conversion), turned into a Request
    # by the coordinator's one Intake; no field of GenerateRequest is left behind on the way.
    import dataclasses

    served_coordinator = served.coordinator
    assert served_coordinator.intake is served_coordinator.intake  # made once, not per call
    asked = {f.name for f in dataclasses.fields(intake.Asked)}
    # GenerateRequest's fields Asked takes under another name, or that decide how many requests there are
    elsewhere = {"prompt_token_ids": "prompt_ids", "n": "api.choices", "best_of": "api.choices"}
    for name in (f.name for f in pb.GenerateRequest.DESCRIPTOR.fields):
        assert name in asked or name in elsewhere, f"GenerateRequest.{name} reaches no field of intake.Asked"
    request = pb.GenerateRequest(
        prompt_token_ids=PROMPT, max_new_tokens=5, temperature=0.5, top_k=3, seed=9, repetition_penalty=1.5
    )
    built = CascadeServicer(served_coordinator)._params(request, None)
    gen = built.gen
    assert (gen.max_new_tokens, gen.temperature, gen.top_k, gen.seed, gen.repetition_penalty) == (5, 0.5, 3, 9, 1.5)
    assert built.explicit_max_new_tokens and built.prompt_ids == tuple(PROMPT)
