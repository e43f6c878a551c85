"""Server reflection v1 and v1alpha as a tool (grpcurl, grpcui, Postman) uses it: a real gRPC client on
loopback, each version's own message classes.

The standalone server with tiny models, with and without API keys: both versions list the same
services, describe CascadeService well enough for a client to rebuild GenerateRequest from the bytes
alone and call Generate with it, describe reflection itself, and answer NOT_FOUND for an unknown
symbol; reflection needs no key where CascadeService does. Also an asyncio server, and Ray Serve's own
proxy server class wired as Ray wires it (`start_grpc_server`) with our `grpc_servicer_functions` in
either order: v1 stays in the proxy (passthrough) beside Ray's v1alpha. Ray's proxy in a running
Serve app: `tests/e2e/test_conformance.py`.
"""

from __future__ import annotations

import asyncio
from typing import Any
from unittest.mock import Mock

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2

from cascade_service.api.server import start_server
from cascade_service.config import (
    GenerationConfig,
    MaGConfig,
    ModelTierConfig,
    make_cascade,
)
from cascade_service.core.cascade import Lookup
from cascade_service.inprocess import InProcess
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.rpc import reflection
from cascade_service.rpc.auth import ApiKeys
from cascade_service.serving.app import GRPC_SERVICER_FUNCTIONS
from cascade_service.sessions import MemoryStore

KEY = "key-reflection-0123456789"
CASCADE, HEALTH = "cascade.v1.CascadeService", "grpc.health.v1.Health"
V1, V1ALPHA = "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"
ADVERTISED = {CASCADE, HEALTH, V1, V1ALPHA}
# Each version's own classes: a v1 client has no v1alpha module, and the reverse.
MESSAGES = {
    "v1": (reflection.ServerReflectionRequest, reflection.ServerReflectionResponse),
    "v1alpha": (reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse),
}
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


@pytest.fixture(scope="module")
def coordinator(tiny_family):
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])), [MaGConfig()], [[4]], 1.5, Lookup(2, 10)
    )
    return InProcess(cascade).coordinator(MemoryStore(), GenerationConfig(max_new_tokens=4))


@pytest.fixture(scope="module", params=["open", "keyed"])
def served(request, coordinator):
    """(address, the key CascadeService needs or None)."""
    key = KEY if request.param == "keyed" else None
    server, port = start_server(coordinator, api_keys=ApiKeys([(KEY, "alice")]) if key else None)
    yield f"127.0.0.1:{port}", key
    server.stop(0)


def _info(channel: Any, version: str, requests: tuple[dict[str, Any], ...]) -> Any:
    """A ServerReflectionInfo call of `version` on a sync or asyncio channel, carrying `requests`
    (each the fields of a request), no key sent."""
    request_class, response_class = MESSAGES[version]
    info = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )
    return info(iter([request_class(**fields) for fields in requests]), timeout=30)


def _checked(version: str, requests: tuple[dict[str, Any], ...], replies: list[Any]) -> list[Any]:
    assert len(replies) == len(requests)
    assert all(r.DESCRIPTOR.full_name == f"grpc.reflection.{version}.ServerReflectionResponse" for r in replies)
    return replies


def _ask(channel: grpc.Channel, version: str, *requests: dict[str, Any]) -> list[Any]:
    """One ServerReflectionInfo stream carrying `requests`: its replies, one per request."""
    return _checked(version, requests, list(_info(channel, version, requests)))


async def _ask_aio(channel: grpc.aio.Channel, version: str, *requests: dict[str, Any]) -> list[Any]:
    """`_ask` on an asyncio channel."""
    return _checked(version, requests, [r async for r in _info(channel, version, requests)])


def _files(reply: Any) -> list[descriptor_pb2.FileDescriptorProto]:
    assert reply.WhichOneof("message_response") == "file_descriptor_response", reply
    return [
        descriptor_pb2.FileDescriptorProto.FromString(b) for b in reply.file_descriptor_response.file_descriptor_proto
    ]


def _pool_of(files: list[descriptor_pb2.FileDescriptorProto]) -> descriptor_pool.DescriptorPool:
    """A fresh pool holding the files as a client gets them (the file first, then its imports)."""
    pool, pending = descriptor_pool.DescriptorPool(), {f.name: f for f in files}

    def add(name: str) -> None:
        file = pending.pop(name, None)
        if file is not None:
            for dependency in file.dependency:
                add(dependency)
            pool.Add(file)

    while pending:
        add(next(iter(pending)))
    return pool


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_describes_the_service_without_a_key(served, version):
    address, _ = served
    with grpc.insecure_channel(address) as channel:
        listed, api, v1_file, v1alpha_file, by_name, unknown = _ask(
            channel,
            version,
            {"list_services": ""},
            {"file_containing_symbol": CASCADE},
            {"file_containing_symbol": V1},
            {"file_containing_symbol": V1ALPHA},
            {"file_by_filename": "grpc/reflection/v1/reflection.proto"},
            {"file_containing_symbol": "no.such.Symbol"},
        )
    assert {s.name for s in listed.list_services_response.service} == ADVERTISED
    files = _files(api)
    assert files[0].name == "cascade/v1/cascade.proto"
    generate_request = _pool_of(files).FindMessageTypeByName("cascade.v1.GenerateRequest")
    assert [(f.name, f.number, f.type) for f in generate_request.fields] == [
        (f.name, f.number, f.type) for f in pb.GenerateRequest.DESCRIPTOR.fields
    ]
    for reply, package in ((v1_file, "grpc.reflection.v1"), (v1alpha_file, "grpc.reflection.v1alpha")):
        [file] = _files(reply)
        assert file.package == package and [s.name for s in file.service] == ["ServerReflection"]
    assert _files(by_name)[0].package == "grpc.reflection.v1"
    assert unknown.WhichOneof("message_response") == "error_response"
    assert unknown.error_response.error_code == NOT_FOUND
    assert unknown.original_request.file_containing_symbol == "no.such.Symbol"


def test_a_client_built_from_reflection_alone_calls_generate(served):
    """What grpcurl does: the request and reply types from v1 reflection, then the call, which needs
    the key where keys are on."""
    address, key = served
    with grpc.insecure_channel(address) as channel:
        [api] = _ask(channel, "v1", {"file_containing_symbol": CASCADE})
        pool = _pool_of(_files(api))
        method = pool.FindServiceByName(CASCADE).methods_by_name["Generate"]
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        generate = channel.unary_unary(
            f"/{CASCADE}/Generate",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        request = request_class(prompt_token_ids=[5, 6, 7], max_new_tokens=3, temperature=0)
        if key is not None:
            with pytest.raises(grpc.RpcError) as refused:
                generate(request, timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = (("authorization", f"Bearer {key}"),) if key else None
        reply = generate(request, timeout=60, metadata=metadata)
    assert len(reply.token_ids) == 3 and reply.finish_reason == "length"


def test_an_asyncio_server_serves_both_versions():
    async def run() -> dict[str, set[str]]:
        server = grpc.aio.server()
        reflection.enable_reflection(server, ["x.Only"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                listed = {}
                for version in MESSAGES:
                    replies = await _ask_aio(channel, version, {"list_services": ""})
                    listed[version] = {s.name for s in replies[0].list_services_response.service}
                return listed
        finally:
            await server.stop(0)

    assert asyncio.run(run()) == {"v1": {"x.Only", V1, V1ALPHA}, "v1alpha": {"x.Only", V1, V1ALPHA}}


@pytest.mark.parametrize(
    "functions", [GRPC_SERVICER_FUNCTIONS, GRPC_SERVICER_FUNCTIONS[::-1]], ids=["as-deployed", "reversed"]
)
def test_on_rays_proxy_server_v1_is_answered_by_the_proxy_beside_v1alpha(functions):
    grpc_util = pytest.importorskip("ray.serve._private.grpc_util")
    from ray.serve.config import gRPCOptions
    from ray.serve.generated.serve_pb2_grpc import (
        add_RayServeAPIServiceServicer_to_server,
    )

    routed: list[str] = []

    def factory(service_method: str, streaming_type: Any) -> Any:
        # Ray's proxy builds a replica-routing handler per method; which ones it built is the check.
        routed.append(service_method)

        async def refuse(request: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"routed to a replica: {service_method}")

        return refuse

    async def run() -> dict[str, tuple[set[str], list[str]]]:
        server = grpc_util.gRPCGenericServer(factory)
        port = server.add_insecure_port("127.0.0.1:0")
        # start_grpc_server's own steps, with Ray's import of the configured functions.
        callables = gRPCOptions(grpc_servicer_functions=list(functions)).grpc_servicer_func_callable
        assert len(callables) == len(functions)  # Ray skips, with a warning only, one it cannot import
        for add in [add_RayServeAPIServiceServicer_to_server, *callables]:
            add(Mock(), server)
        grpc_util.enable_server_reflection(server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                answers = {}
                for version in MESSAGES:
                    listed, api = await _ask_aio(
                        channel, version, {"list_services": ""}, {"file_containing_symbol": CASCADE}
                    )
                    answers[version] = (
                        {s.name for s in listed.list_services_response.service},
                        [f.name for f in _files(api)],
                    )
                return answers
        finally:
            await server.stop(0)

    answers = asyncio.run(run())
    for version in MESSAGES:
        assert answers[version] == (ADVERTISED, ["cascade/v1/cascade.proto"]), version
    assert any(m.startswith(f"/{CASCADE}/") for m in routed)
    assert not [m for m in routed if m.startswith("/grpc.reflection.")]  # both stay in the proxy
