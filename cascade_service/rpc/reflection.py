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
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from ..proto.v1 import cascade_pb2

V1ALPHA = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1 = "grpc.reflection.v1.ServerReflection"
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
METHOD = "ServerReflectionInfo"
V1_METHOD_PATH = f"/{V1}/{METHOD}"
# What the service advertises, besides the two reflection services.
SERVICES = (
    cascade_pb2.DESCRIPTOR.services_by_name["CascadeService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
)


def v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1's file descriptor: v1alpha's with the file, the package and every type reference renamed."""
    v1 = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(v1)
    old, new = f".{v1.package}.", f".{V1_PACKAGE}."
    v1.name, v1.package = V1_FILE, V1_PACKAGE

    def rename(name: str) -> str:
        return new + name[len(old) :] if name.startswith(old) else name

    def fields(messages: Iterable[descriptor_pb2.DescriptorProto]) -> Iterable[descriptor_pb2.FieldDescriptorProto]:
        for message in messages:
            yield from message.field
            yield from message.extension
            yield from fields(message.nested_type)

    for field in (*fields(v1.message_type), *v1.extension):
        # Only set names are renamed: a scalar field must not gain an empty type_name / extendee.
        if field.HasField("type_name"):
            field.type_name = rename(field.type_name)
        if field.HasField("extendee"):
            field.extendee = rename(field.extendee)
    for service in v1.service:
        for method in service.method:
            method.input_type, method.output_type = rename(method.input_type), rename(method.output_type)
    # v1's own file options: v1alpha's name v1alpha's packages and mark the file deprecated.
    v1.options.Clear()
    v1.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    v1.options.java_multiple_files = True
    v1.options.java_package = "io.grpc.reflection.v1"
    v1.options.java_outer_classname = "ServerReflectionProto"
    return v1


def _register_v1() -> None:
    """Put v1's file in the default pool, once: a process may import this module again, or have v1's
    file from elsewhere already (then that one is used)."""
    try:
        # A grpcio-reflection that ships v1 adds protoc's own file; adding ours first would make its
        # import fail on a duplicate file name whose bytes differ.
        import grpc_reflection.v1.reflection_pb2  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        pass
    pool = descriptor_pool.Default()
    # Either is there already: v1's symbols under another file name (grpcio names v1alpha's file
    # grpc_reflection/v1alpha/reflection.proto) or a file of our name; adding ours would clash.
    for find, name in ((pool.FindFileContainingSymbol, V1), (pool.FindFileByName, V1_FILE)):
        try:
            find(name)
            return
        except KeyError:
            pass
    pool.AddSerializedFile(v1_file().SerializeToString())  # the path generated _pb2 modules take


_register_v1()
# v1's message classes, for a v1 client (a server needs none: v1alpha's messages are v1's on the wire).
ServerReflectionRequest = message_factory.GetMessageClass(
    descriptor_pool.Default().FindMessageTypeByName(f"{V1_PACKAGE}.ServerReflectionRequest")
)
ServerReflectionResponse = message_factory.GetMessageClass(
    descriptor_pool.Default().FindMessageTypeByName(f"{V1_PACKAGE}.ServerReflectionResponse")
)


def v1_info(channel: grpc.Channel) -> Any:
    """A client's v1 `ServerReflectionInfo` on `channel` (a stream-stream callable of v1's messages)."""
    return channel.stream_stream(
        V1_METHOD_PATH,
        request_serializer=ServerReflectionRequest.SerializeToString,
        response_deserializer=ServerReflectionResponse.FromString,
    )


def enable_reflection(server: Any, service_names: Iterable[str] = SERVICES) -> None:
    """Serve reflection v1alpha and v1 on a `grpc.Server` or `grpc.aio.Server`, advertising
    `service_names` and both reflection services."""
    names = advertised(service_names)
    reflection.enable_server_reflection(names, server)  # v1alpha: picks the asyncio servicer itself
    server.add_generic_rpc_handlers((_v1_handler(names, isinstance(server, grpc.aio.Server)),))


def add_reflection_v1(servicer: Any, server: Any) -> None:
    """A `grpc_servicer_functions` entry for Ray Serve's gRPC proxy: v1 beside the v1alpha Ray serves.

    Ray calls it as fn(servicer, server) on its proxy's asyncio server, then enables v1alpha itself.
    v1 is registered as a passthrough service, as Ray does v1alpha, so the proxy answers it instead of
    routing it to a replica; it must be marked before its handlers are added, which Ray's server
    checks then. The list is fixed rather than read from the server, so it is right whichever entries
    come after this one and before Ray's own reflection. `servicer` (Ray's placeholder) is not used.
    On another server (no passthrough services) the handler is simply added.
    """
    if hasattr(server, "add_passthrough_service"):
        server.add_passthrough_service(V1)
    server.add_generic_rpc_handlers((_v1_handler(advertised(SERVICES), isinstance(server, grpc.aio.Server)),))


def advertised(service_names: Iterable[str]) -> list[str]:
    """`service_names` and both reflection services, each once: what reflection lists."""
    return [*dict.fromkeys([*service_names, V1ALPHA, V1])]


def _v1_handler(names: list[str], asyncio: bool) -> grpc.GenericRpcHandler:
    # v1alpha's servicer reads and writes v1alpha's messages, which are v1's on the wire.
    servicer = reflection.aio.ReflectionServicer(names) if asyncio else reflection.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(V1, {METHOD: handler})
