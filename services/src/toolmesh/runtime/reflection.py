"""Server reflection, v1 and v1alpha, serving toolmesh's descriptors with their comments.

grpcio-reflection serves only `grpc.reflection.v1alpha`, and rebuilds each file
from the descriptor pool, where the generated stubs left no comments. Tools
ask for `grpc.reflection.v1` first (grpcurl, buf curl, Postman), and a client
author reading the contract through reflection should read what the protos
say. So the same servicer also answers as v1 (its messages are the same on the
wire), and our files are served from the descriptor set that
scripts/gen_protos.py writes with their comments (descriptors.binpb).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from importlib.resources import files
from typing import Any, cast

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

V1ALPHA = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _commented_files() -> dict[str, bytes]:
    """Our .proto files, serialized with their comments, by file name."""
    raw = files("toolmesh.runtime").joinpath("descriptors.binpb").read_bytes()
    return {
        file.name: file.SerializeToString() for file in descriptor_pb2.FileDescriptorSet.FromString(raw).file
    }


def _describe_v1() -> None:
    """Put grpc.reflection.v1 in the default pool (v1alpha's file under v1's names), for `describe`."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.options.Clear()
    pool.Add(proto)


class CommentedReflection:
    """grpcio-reflection's servicer, with our files swapped for their commented copies."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self._inner = ReflectionServicer(service_names)
        self._commented = _commented_files()

    async def ServerReflectionInfo(
        self, request_iterator: Any, context: Any
    ) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        """Answer each reflection request (see grpc.reflection.v1alpha)."""
        # An async generator: the typing stubs call it a coroutine.
        answers = cast(
            AsyncIterator[reflection_pb2.ServerReflectionResponse],
            self._inner.ServerReflectionInfo(request_iterator, context),
        )
        async for response in answers:
            if response.HasField("file_descriptor_response"):
                served = response.file_descriptor_response.file_descriptor_proto
                for index, raw in enumerate(served):
                    name = descriptor_pb2.FileDescriptorProto.FromString(raw).name
                    if name in self._commented:
                        served[index] = self._commented[name]
            yield response


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection on `server` as v1 and v1alpha, for `service_names` and themselves."""
    _describe_v1()
    servicer = CommentedReflection([*service_names, V1, V1ALPHA])
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": method})
            for name in (V1, V1ALPHA)
        ]
    )
