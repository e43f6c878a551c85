"""Reflection v1 is v1alpha renamed: the derived descriptor has v1's names and v1alpha's layout, it is in
the default pool once whoever imports it first, and v1's message classes are v1alpha's on the wire."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2

from cascade_service.rpc import reflection

ROOT = Path(__file__).resolve().parents[2]


def _layout(file: descriptor_pb2.FileDescriptorProto) -> list:
    """Messages and fields with the package taken out of every type name."""

    def local(name: str) -> str:
        return name.removeprefix(f".{file.package}.")

    return [
        (
            m.name,
            [
                (
                    f.name,
                    f.number,
                    f.type,
                    f.label,
                    f.oneof_index if f.HasField("oneof_index") else None,
                    local(f.type_name),
                )
                for f in m.field
            ],
            [o.name for o in m.oneof_decl],
        )
        for m in file.message_type
    ]


def test_the_v1_file_is_v1alpha_under_v1s_names():
    v1 = reflection.v1_file()
    assert (v1.name, v1.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    assert b"v1alpha" not in v1.SerializeToString()
    assert "v1alpha" not in str(v1)
    alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(alpha)
    assert _layout(v1) == _layout(alpha)
    message_fields = [f for m in v1.message_type for f in m.field if f.type == f.TYPE_MESSAGE]
    assert message_fields and all(f.type_name.startswith(".grpc.reflection.v1.") for f in message_fields)
    [service] = v1.service
    assert service.name == "ServerReflection"
    assert [(m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming) for m in service.method] == [
        (
            "ServerReflectionInfo",
            ".grpc.reflection.v1.ServerReflectionRequest",
            ".grpc.reflection.v1.ServerReflectionResponse",
            True,
            True,
        )
    ]
    assert not v1.options.deprecated  # v1alpha's file is; v1 is the current version


def test_the_v1_service_is_in_the_default_pool_and_a_second_import_is_harmless():
    importlib.reload(reflection)
    reflection._register_v1()
    service = descriptor_pool.Default().FindServiceByName(reflection.V1)
    assert service.file.name == reflection.V1_FILE
    assert (
        service.methods_by_name["ServerReflectionInfo"].input_type.full_name
        == "grpc.reflection.v1.ServerReflectionRequest"
    )
    assert descriptor_pool.Default().FindFileContainingSymbol(reflection.V1).name == reflection.V1_FILE


def test_v1s_messages_are_v1alphas_on_the_wire():
    request = reflection.ServerReflectionRequest(host="h", file_containing_symbol="cascade.v1.CascadeService")
    assert request.DESCRIPTOR.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    as_alpha = reflection_pb2.ServerReflectionRequest.FromString(request.SerializeToString())
    assert (as_alpha.host, as_alpha.file_containing_symbol) == ("h", "cascade.v1.CascadeService")
    alpha_reply = reflection_pb2.ServerReflectionResponse(
        original_request=as_alpha,
        list_services_response=reflection_pb2.ListServiceResponse(service=[{"name": reflection.V1}]),
    )
    reply = reflection.ServerReflectionResponse.FromString(alpha_reply.SerializeToString())
    assert reply.WhichOneof("message_response") == "list_services_response"
    assert [s.name for s in reply.list_services_response.service] == [reflection.V1]
    assert reply.original_request == request


@pytest.mark.parametrize("name", ["grpc/reflection/v1/reflection.proto", "grpc_reflection/v1/reflection.proto"])
def test_a_v1_file_added_by_someone_else_first_is_kept(name):
    # Another producer's v1 file, under v1's own file name or grpcio's style of name, and with other
    # options than ours (protoc's would differ too): importing ours after it must not fail, and v1's
    # classes then come from it.
    script = textwrap.dedent(f"""
        from google.protobuf import descriptor_pb2, descriptor_pool, text_format
        from grpc_reflection.v1alpha import reflection_pb2

        alpha = descriptor_pb2.FileDescriptorProto()
        reflection_pb2.DESCRIPTOR.CopyToProto(alpha)
        theirs = text_format.Parse(text_format.MessageToString(alpha).replace("v1alpha", "v1"),
                                   descriptor_pb2.FileDescriptorProto())
        theirs.name = "{name}"
        assert theirs.options.deprecated
        descriptor_pool.Default().AddSerializedFile(theirs.SerializeToString())

        from cascade_service.rpc import reflection
        assert reflection.ServerReflectionRequest.DESCRIPTOR.file.name == "{name}"
        assert reflection.ServerReflectionRequest.DESCRIPTOR.file.GetOptions().deprecated
        assert reflection.ServerReflectionRequest.DESCRIPTOR.full_name == "grpc.reflection.v1.ServerReflectionRequest"
        print("ok")
    """)
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
