"""Access control (rpc/auth.py): API keys, sessions bound to the key that made them, and TLS (`serve`'s
loopback rule: test_serve_access.py). The standalone server on loopback with tiny models, the real client
SDK; the edge with a fake backend (no Ray) for the owner id it forwards.
"""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cascade_service.api.backend import RecordingContext
from cascade_service.api.edge import start_edge
from cascade_service.api.server import start_server
from cascade_service.api.servicer import CascadeServicer
from cascade_service.cli import main
from cascade_service.client import CascadeClient, errors
from cascade_service.config import (
    GenerationConfig,
    MaGConfig,
    ModelTierConfig,
    make_cascade,
)
from cascade_service.core.cascade import Lookup
from cascade_service.inprocess import InProcess
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.rpc.auth import TlsFiles, load_api_keys, owner_id
from cascade_service.sessions import MemoryStore
from cascade_service.zoo.tiny import random_prompts

from ..helpers.access import KEY_A, KEY_B

PROMPT = random_prompts(1, 12, seed=21)[0]


@pytest.fixture(scope="module")
def coordinator(tiny_family):
    drafters = [ModelTierConfig("close", str(tiny_family["close"])), MaGConfig()]
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])), drafters, [[4, 0], [0, 6]], 1.5, Lookup(2, 10)
    )
    return InProcess(cascade).coordinator(MemoryStore(), GenerationConfig(max_new_tokens=8))


@pytest.fixture(scope="module")
def target(coordinator, keys_file):
    server, port = start_server(coordinator, api_keys=load_api_keys(keys_file))
    yield f"127.0.0.1:{port}"
    server.stop(0)


# ---- keys ----------------------------------------------------------------------------------------


def test_the_keys_file_takes_names_and_comments_and_never_shows_a_key(keys_file, tmp_path):
    keys = load_api_keys(keys_file)
    assert len(keys) == 2 and KEY_A not in repr(keys)
    assert keys.check(KEY_A).name == "alice" and keys.check(KEY_B).name == "bob"
    assert keys.check(KEY_A).owner == owner_id(KEY_A) != owner_id(KEY_B)
    assert KEY_A not in owner_id(KEY_A) and len(owner_id(KEY_A)) == 32
    assert keys.check("nope") is None and keys.check("") is None and keys.check(None) is None
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no keys"):
        load_api_keys(empty)
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(tmp_path / "missing.txt")


def test_no_key_or_a_wrong_key_is_unauthenticated_and_the_key_is_never_echoed(target, caplog):
    caplog.set_level(logging.DEBUG)
    with CascadeClient(target, timeout_s=30) as client:
        with pytest.raises(errors.Unauthenticated, match="missing API key"):
            client.generate(prompt_token_ids=PROMPT)
        with pytest.raises(errors.Unauthenticated):
            list(client.stream(prompt_token_ids=PROMPT))
        with pytest.raises(errors.Unauthenticated):
            client.create_session(prompt_token_ids=PROMPT)
    with CascadeClient(target, timeout_s=30, api_key="wrong-key-xyz") as client:
        for call in (
            lambda: client.generate(prompt_token_ids=PROMPT),
            lambda: client.get_session("s-1"),
            lambda: client.delete_session("s-1"),
            lambda: list(client.stream(prompt_token_ids=PROMPT)),
        ):
            with pytest.raises(errors.Unauthenticated, match="unknown API key") as info:
                call()
            assert "wrong-key-xyz" not in info.value.details
    assert "wrong-key-xyz" not in caplog.text and KEY_A not in caplog.text


def test_a_right_key_works_and_health_and_reflection_need_none(target):
    with CascadeClient(target, timeout_s=60, api_key=KEY_A) as client:
        result = client.generate(prompt_token_ids=PROMPT, max_new_tokens=6)
        assert len(result.token_ids) == 6
        assert [
            t for c in client.stream(prompt_token_ids=PROMPT, max_new_tokens=6) for t in c.token_ids
        ] == result.token_ids
    with CascadeClient(target, timeout_s=30) as anonymous:
        assert anonymous.health() == "SERVING"
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="cascade.v1.CascadeService"), timeout=10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        services = {s.name for a in answers for s in a.list_services_response.service}
    assert "cascade.v1.CascadeService" in services


# ---- sessions belong to their key ----------------------------------------------------------------


def test_a_session_belongs_to_the_key_that_created_it(target, coordinator):
    with (
        CascadeClient(target, timeout_s=60, api_key=KEY_A) as a,
        CascadeClient(target, timeout_s=60, api_key=KEY_B) as b,
    ):
        session = a.create_session(prompt_token_ids=PROMPT)
        sid = session.session_id
        stored = coordinator.store.get(sid)
        assert stored.owner == owner_id(KEY_A) and KEY_A not in stored.owner
        for call in (
            lambda: b.get_session(sid),
            lambda: b.delete_session(sid),
            lambda: b.generate(prompt_token_ids=[5], session_id=sid, max_new_tokens=4),
            lambda: list(b.stream(prompt_token_ids=[5], session_id=sid, max_new_tokens=4)),
        ):
            with pytest.raises(errors.PermissionDenied, match="session_id") as info:
                call()
            assert sid in info.value.details and KEY_A not in info.value.details
        assert a.get_session(sid).version == 0  # B changed nothing
        first = a.generate(prompt_token_ids=[5], session_id=sid, max_new_tokens=4)
        assert first.session_length == len(PROMPT) + 1 + 4
        assert a.get_session(sid).version == 1
        assert a.delete_session(sid) is True
        with pytest.raises(errors.NotFound):
            a.get_session(sid)
        assert b.delete_session(sid) is False  # gone: nothing to refuse


def test_without_keys_sessions_are_anonymous_and_open_but_keyed_ones_stay_closed(coordinator):
    server, port = start_server(coordinator)
    try:
        with (
            CascadeClient(f"127.0.0.1:{port}", timeout_s=60) as c,
            CascadeClient(f"127.0.0.1:{port}", timeout_s=60, api_key="ignored-without-keys") as d,
        ):
            session = c.create_session(prompt_token_ids=PROMPT)
            assert coordinator.store.get(session.session_id).owner == ""
            assert d.get_session(session.session_id).token_ids == PROMPT  # a key changes nothing here
            assert d.generate(prompt_token_ids=[5], session_id=session.session_id, max_new_tokens=3).session_length
            assert d.delete_session(session.session_id) is True
            keyed = coordinator.store.create([1, 2], owner=owner_id(KEY_A))  # made while keys were on
            with pytest.raises(errors.PermissionDenied, match=keyed.session_id):
                c.get_session(keyed.session_id)
    finally:
        server.stop(0)


# ---- the edge: one interceptor, and the owner id travels with the bytes ---------------------------


class FakeBackend:
    """Plays the coordinator deployment: runs the servicer on the call's message with a
    RecordingContext(owner), as `serving.app.CoordinatorDeployment.serve` does."""

    def __init__(self, coordinator):
        self.servicer = CascadeServicer(coordinator)
        self.owners: list[str] = []

    def call(self, call):
        self.owners.append(call.owner)
        context = RecordingContext(call.owner)
        response = getattr(self.servicer, call.method)(call.request, context)
        return context.code.name, context.details, response.SerializeToString()

    def stream(self, call):
        self.owners.append(call.owner)
        context = RecordingContext(call.owner)
        for chunk in getattr(self.servicer, call.method)(call.request, context):
            yield "OK", "", chunk.SerializeToString()
        if context.code.name != "OK":
            yield context.code.name, context.details, b""


def test_the_edge_checks_keys_and_forwards_the_callers_owner_id(coordinator, keys_file):
    backend = FakeBackend(coordinator)
    server, port, _ = start_edge(backend, api_keys=load_api_keys(keys_file))
    try:
        edge = f"127.0.0.1:{port}"
        with CascadeClient(edge, timeout_s=60) as anonymous:
            with pytest.raises(errors.Unauthenticated):
                anonymous.create_session(prompt_token_ids=PROMPT)
        assert backend.owners == []  # refused at the edge: nothing forwarded
        with (
            CascadeClient(edge, timeout_s=60, api_key=KEY_A) as a,
            CascadeClient(edge, timeout_s=60, api_key=KEY_B) as b,
        ):
            sid = a.create_session(prompt_token_ids=PROMPT).session_id
            with pytest.raises(errors.PermissionDenied, match=sid):
                b.get_session(sid)
            with pytest.raises(errors.PermissionDenied, match=sid):
                list(b.stream(prompt_token_ids=[5], session_id=sid, max_new_tokens=3))
            assert a.generate(prompt_token_ids=[5], session_id=sid, max_new_tokens=3).session_length
            assert a.delete_session(sid) is True
        assert set(backend.owners) == {owner_id(KEY_A), owner_id(KEY_B)}
    finally:
        server.stop(0)


# ---- TLS -----------------------------------------------------------------------------------------


def test_tls_round_trip_with_a_self_signed_certificate(coordinator, keys_file, cert):
    cert_file, key_file, cert_pem = cert
    server, port = start_server(coordinator, api_keys=load_api_keys(keys_file), tls=TlsFiles(cert_file, key_file))
    target = f"127.0.0.1:{port}"
    try:
        with CascadeClient(target, timeout_s=60, api_key=KEY_A, tls=True, root_certificates=cert_pem) as client:
            assert client.health() == "SERVING"
            assert len(client.generate(prompt_token_ids=PROMPT, max_new_tokens=4).token_ids) == 4
        with CascadeClient(target, timeout_s=60, tls=True, root_certificates=cert_pem) as no_key:
            with pytest.raises(errors.Unauthenticated):
                no_key.generate(prompt_token_ids=PROMPT, max_new_tokens=4)
        with CascadeClient(target, timeout_s=5, api_key=KEY_A) as plaintext:  # TLS only: plaintext fails
            with pytest.raises(errors.Unavailable):
                plaintext.generate(prompt_token_ids=PROMPT, max_new_tokens=4)
    finally:
        server.stop(0)


# ---- Ray Serve's gRPC proxy (a cluster's front end) runs no interceptor: the coordinator checks ----


class ProxyContext:
    """What Ray's proxy hands the coordinator's methods (a RayServegRPCContext's interface): metadata
    in, status out."""

    def __init__(self, key: str | None = None):
        self.metadata = [("authorization", f"Bearer {key}")] if key else []
        self._code, self._details, self.trailing = None, "", ()

    def invocation_metadata(self):
        return self.metadata

    def code(self):
        return self._code

    def details(self):
        return self._details

    def set_code(self, code):
        self._code = code

    def set_details(self, details):
        self._details = details

    def set_trailing_metadata(self, metadata):
        self.trailing = metadata


def test_the_coordinator_checks_keys_of_calls_from_rays_proxy(coordinator, config_file, keys_file, tmp_path):
    import asyncio

    from cascade_service.serving.app import CoordinatorDeployment
    from cascade_service.serving.calls import StreamFailed

    configured = tmp_path / "keys.yaml"
    configured.write_text(config_file.read_text() + f"serving:\n  api_keys_file: {keys_file}\n")
    # Serve's ingress wrapper has an async __init__ (the coordinator also serves HTTP): made as Serve does.
    cls = CoordinatorDeployment.func_or_class
    deployment = cls.__new__(cls)
    asyncio.run(deployment.__init__(str(configured), {}))
    deployment._servicer = CascadeServicer(coordinator)  # no tiers to ask: the in-process coordinator

    async def stream(request, context):
        return [c async for c in deployment.GenerateStream(request, context)]

    request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=3)
    for context in (ProxyContext(), ProxyContext("wrong-key-xyz")):
        assert not asyncio.run(deployment.Generate(request, context)).token_ids
        assert context.code() == grpc.StatusCode.UNAUTHENTICATED and "wrong-key-xyz" not in context.details()
        streamed = ProxyContext("wrong-key-xyz")
        # A stream ends by raising, with the code set, so that Ray's proxy reports it (not OK and empty).
        with pytest.raises(StreamFailed):
            asyncio.run(stream(request, streamed))
        assert streamed.code() == grpc.StatusCode.UNAUTHENTICATED
    a, b = ProxyContext(KEY_A), ProxyContext(KEY_B)
    session = asyncio.run(deployment.CreateSession(pb.CreateSessionRequest(prompt_token_ids=PROMPT), a))
    assert a.code() is None and coordinator.store.get(session.session_id).owner == owner_id(KEY_A)
    asyncio.run(deployment.GetSession(pb.GetSessionRequest(session_id=session.session_id), b))
    assert b.code() == grpc.StatusCode.PERMISSION_DENIED and session.session_id in b.details()
    assert len(asyncio.run(deployment.Generate(request, ProxyContext(KEY_B))).token_ids) == 3


def test_the_client_command_takes_the_key_from_the_environment_and_speaks_tls(
    coordinator, keys_file, cert, capsys, monkeypatch
):
    cert_file, key_file, _ = cert
    server, port = start_server(coordinator, api_keys=load_api_keys(keys_file), tls=TlsFiles(cert_file, key_file))
    argv = [
        "client",
        "session-create",
        "--target",
        f"127.0.0.1:{port}",
        "--tls",
        "--root-cert",
        cert_file,
        "--prompt",
        "x = 1",
    ]
    try:
        monkeypatch.delenv("CASCADE_API_KEY", raising=False)
        assert main(argv) != 0
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        monkeypatch.setenv("CASCADE_API_KEY", KEY_A)
        assert main(argv) == 0
        assert '"version": 0' in capsys.readouterr().out
    finally:
        server.stop(0)
