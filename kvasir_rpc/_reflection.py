"""Server reflection in both protocols a client may speak: ``grpc.reflection.v1`` (tried
first by ``buf curl`` and ``grpcurl``) and the older ``grpc.reflection.v1alpha``.

grpcio-reflection ships only v1alpha. v1 is the same protocol under a new package name:
same messages, same field numbers, so the same bytes on the wire. So the v1 service here
is the v1alpha servicer registered a second time under the v1 name, and the v1 file
descriptor is derived from v1alpha's (package and type names renamed) and added to the
default descriptor pool, so that reflection can describe the v1 service too.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool

__all__ = ["REFLECTION_SERVICES", "enable_reflection", "reflection_v1_file", "start_with_health"]

_V1 = "grpc.reflection.v1"
_V1ALPHA = "grpc.reflection.v1alpha"
_SERVICE = "ServerReflection"
# Newest first, the order in which clients try them.
REFLECTION_SERVICES = (f"{_V1}.{_SERVICE}", f"{_V1ALPHA}.{_SERVICE}")
# Where upstream keeps the v1 file (grpc/grpc-proto), so a client sees the familiar name.
_V1_FILE_NAME = "grpc/reflection/v1/reflection.proto"

_add_lock = threading.Lock()


def _derive_v1(alpha: descriptor.FileDescriptor) -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's FileDescriptorProto with its package, and every type name in it, moved to v1."""
    proto = descriptor_pb2.FileDescriptorProto()
    alpha.CopyToProto(proto)
    old, new = f".{_V1ALPHA}.", f".{_V1}."

    def rename(type_name: str) -> str:
        if not type_name.startswith(old):
            raise RuntimeError(f"unexpected type {type_name!r} in {alpha.name}: cannot derive reflection v1")
        return new + type_name[len(old):]

    proto.name = _V1_FILE_NAME
    proto.package = _V1
    for message in proto.message_type:
        if message.nested_type or message.enum_type or message.extension:
            raise RuntimeError(f"{alpha.name} has nested types: cannot derive reflection v1")
        for field in message.field:
            if field.type_name:
                field.type_name = rename(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type = rename(method.input_type)
            method.output_type = rename(method.output_type)
    # v1 is current (v1alpha is marked deprecated) and lives in its own language packages.
    proto.options.Clear()
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    proto.options.java_multiple_files = True
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    return proto


@functools.cache
def reflection_v1_file() -> descriptor.FileDescriptor:
    """The file descriptor of ``grpc.reflection.v1`` in the default descriptor pool.

    The first call adds it, derived from grpcio-reflection's v1alpha file, unless the pool
    already has it (a grpcio-reflection that ships ``grpc_reflection.v1`` is preferred).
    Clients can build the v1 messages from it with ``message_factory.GetMessageClass``."""
    pool = descriptor_pool.Default()
    with _add_lock:
        try:  # a future grpcio-reflection with its own v1: use it, never define the names twice
            importlib.import_module("grpc_reflection.v1.reflection_pb2")
        except ImportError:
            pass
        try:
            return pool.FindFileContainingSymbol(REFLECTION_SERVICES[0])
        except KeyError:
            pass
        from grpc_reflection.v1alpha import reflection_pb2

        return pool.AddSerializedFile(_derive_v1(reflection_pb2.DESCRIPTOR).SerializeToString())


def enable_reflection(server: grpc.Server, service_names: Iterable[str]) -> None:
    """Serve reflection v1 and v1alpha on ``server`` (call before ``server.start()``).

    ``service_names``: the fully qualified services the server offers, each of them in the
    default descriptor pool (import its ``_pb2`` module first); both reflection services
    are added to the list that clients see. Raises ValueError naming any service reflection
    could not describe. Adds the v1 descriptor to the default pool (see reflection_v1_file)."""
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    if isinstance(service_names, str):
        raise TypeError(f"service_names must be a list of service names, not the string {service_names!r}")
    names = [*dict.fromkeys([*service_names, *REFLECTION_SERVICES])]
    reflection_v1_file()
    pool = descriptor_pool.Default()
    unknown = []
    for name in names:
        try:
            pool.FindServiceByName(name)
        except KeyError:
            unknown.append(name)
    if unknown:
        raise ValueError(f"reflection cannot describe {unknown}: not in the default descriptor pool "
                         "(import the service's _pb2 module before enabling reflection)")
    servicer = reflection.ReflectionServicer(names)
    # The messages of both versions are the same bytes, so v1alpha's (de)serializers and its
    # servicer answer v1 callers exactly.
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    for service in REFLECTION_SERVICES:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)


def start_with_health(server: grpc.Server, address: str, service_name: str) -> tuple[int, Any]:
    """Add the standard health service and reflection (v1, v1alpha) for ``service_name`` to
    ``server`` (its servicer already added), bind ``address`` (see bind_grpc) and start it;
    once started, health says SERVING for the service and the server. Returns ``(port,
    health servicer)``: ``enter_graceful_shutdown()`` says NOT_SERVING before a stop."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from kvasir_rpc._listen import bind_grpc

    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, [service_name, health.SERVICE_NAME])
    port = bind_grpc(server, address)
    server.start()
    health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return port, health_servicer
