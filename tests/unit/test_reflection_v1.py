"""Reflection v1 is v1alpha renamed: the derived descriptor has v1's names and v1alpha's layout."""

from __future__ import annotations

from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2

from cascade_service.api import reflection


def test_the_v1_file_is_v1alpha_under_v1s_names():
    v1 = reflection.v1_file()
    assert (v1.name, v1.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    assert b"v1alpha" not in v1.SerializeToString()
    alpha = reflection_pb2.DESCRIPTOR
    assert [m.name for m in v1.message_type] == list(alpha.message_types_by_name)
    for message in v1.message_type:
        fields = alpha.message_types_by_name[message.name].fields
        assert [(f.name, f.number, f.type) for f in message.field] == [(f.name, f.number, f.type) for f in fields]
    [service] = v1.service
    assert service.name == "ServerReflection"
    assert [(m.name, m.client_streaming, m.server_streaming) for m in service.method] == \
        [("ServerReflectionInfo", True, True)]


def test_the_v1_service_is_in_the_default_pool_once_registered():
    reflection._register_v1()
    reflection._register_v1()  # idempotent
    service = descriptor_pool.Default().FindServiceByName(reflection.V1)
    assert service.methods_by_name["ServerReflectionInfo"].input_type.full_name == \
        "grpc.reflection.v1.ServerReflectionRequest"
