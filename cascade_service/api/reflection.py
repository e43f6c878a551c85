"""gRPC server reflection, versions v1 and v1alpha, on every front end.

Current tools (grpcurl, grpcui, Postman, @grpc/reflection) ask for `grpc.reflection.v1` first;
grpcio-reflection ships only v1alpha. The two protocols have the same messages and the same wire
format, only the package differs, so v1 is served by v1alpha's servicer under v1's method path, and
v1's file descriptor (v1alpha's, renamed) is added to the descriptor pool so that reflection can
describe v1 itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from .v1 import cascade_pb2

V1ALPHA = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1 = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
METHOD = "ServerReflectionInfo"
# What the service advertises, besides the two reflection services.
SERVICES = (cascade_pb2.DESCRIPTOR.services_by_name["CascadeService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)


def v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1's file descriptor: v1alpha's with the file, the package and every type reference renamed."""
    alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(alpha)
    text = alpha.SerializeToString()
    old_package, new_package = alpha.package, "grpc.reflection.v1"
    v1 = descriptor_pb2.FileDescriptorProto.FromString(text)
    v1.name, v1.package = V1_FILE, new_package
    for message in v1.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # a message field; scalars must not gain an empty one
                field.type_name = field.type_name.replace(f".{old_package}.", f".{new_package}.")
    for service in v1.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old_package}.", f".{new_package}.")
            method.output_type = method.output_type.replace(f".{old_package}.", f".{new_package}.")
    # v1's own file options (v1alpha's name its packages and mark the file deprecated).
    v1.options.Clear()
    v1.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    v1.options.java_multiple_files = True
    v1.options.java_package = "io.grpc.reflection.v1"
    v1.options.java_outer_classname = "ServerReflectionProto"
    return v1


def _register_v1() -> None:
    """Add v1's file to the default pool once (another library may have added it already)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.Add(v1_file())


def enable_reflection(server: Any, service_names: Iterable[str] = SERVICES) -> None:
    """Serve reflection v1alpha and v1 on a `grpc.Server` or `grpc.aio.Server`, advertising
    `service_names` and both reflection services."""
    names = _names(service_names)
    reflection.enable_server_reflection(names, server)  # v1alpha: picks the asyncio servicer itself
    server.add_generic_rpc_handlers((_v1_handler(names, isinstance(server, grpc.aio.Server)),))


def add_reflection_v1(servicer: Any, server: Any) -> None:
    """A `grpc_servicer_functions` entry for Ray Serve's gRPC proxy: v1 beside the v1alpha Ray serves.

    Ray calls it as fn(servicer, server) on its proxy's asyncio server, then enables v1alpha itself.
    v1 is registered as a passthrough service, as Ray does v1alpha, so the proxy answers it instead of
    routing it to a replica. `servicer` (Ray passes a placeholder) is not used.
    """
    if hasattr(server, "add_passthrough_service"):
        server.add_passthrough_service(V1)
    server.add_generic_rpc_handlers((_v1_handler(_names(SERVICES), True),))


def _names(service_names: Iterable[str]) -> list[str]:
    return [*dict.fromkeys([*service_names, V1ALPHA, V1])]


def _v1_handler(names: list[str], asyncio: bool) -> grpc.GenericRpcHandler:
    _register_v1()
    # v1alpha's servicer reads and writes v1alpha's messages, which are v1's on the wire.
    servicer = reflection.aio.ReflectionServicer(names) if asyncio else reflection.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(V1, {METHOD: handler})
