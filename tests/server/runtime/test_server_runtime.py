"""Standard services on every server, and a graceful stop on SIGTERM."""

from __future__ import annotations

import os

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from toolmesh.assembly.system import LocalSystem
from toolmesh_testing import health_check, reflection_info, start_service_process

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SERVICES = {
    "registry": "toolmesh.v1.RegistryService",
    "invocation": "toolmesh.v1.InvocationService",
    "bridge": "toolmesh.v1.BridgeService",
}


@pytest.mark.parametrize("name", sorted(SERVICES))
async def test_health_and_reflection(system: LocalSystem, name: str) -> None:
    target = getattr(system, f"{name}_target")
    async with grpc.aio.insecure_channel(target) as channel:
        check = health_check(channel)
        for service in ("", SERVICES[name]):
            response = await check(health_pb2.HealthCheckRequest(service=service))
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        responses = reflection_info(channel)(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for listing in responses:
            names = {service.name for service in listing.list_services_response.service}
            assert SERVICES[name] in names and "grpc.health.v1.Health" in names
            break


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_serves_the_contract_with_its_comments(system: LocalSystem, version: str) -> None:
    async with grpc.aio.insecure_channel(system.invocation_target) as channel:
        ask = reflection_info(channel, version)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="toolmesh.v1.InvocationService"),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol=f"grpc.reflection.{version}.ServerReflection"
            ),
        ]
        listing, described, itself = [response async for response in ask(iter(requests))]
    names = {service.name for service in listing.list_services_response.service}
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = {
        proto.name: proto
        for proto in map(
            descriptor_pb2.FileDescriptorProto.FromString,
            described.file_descriptor_response.file_descriptor_proto,
        )
    }
    comments = " ".join(
        location.leading_comments
        for location in files["toolmesh/v1/invocation.proto"].source_code_info.location
    )
    # What a client author needs, where reflection shows it.
    assert "InvokeTool makes one tool call" in comments and "toolmesh-tool-request-id" in comments
    assert itself.HasField("file_descriptor_response"), itself


@pytest.mark.parametrize("service", ["registry", "bridge"])
async def test_service_process_stops_gracefully_on_sigterm(service: str) -> None:
    running = await start_service_process(service, env=dict(os.environ))
    async with grpc.aio.insecure_channel(running.target) as channel:
        response = await health_check(channel)(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    await running.stop()
    assert running.process.returncode == 0
    assert any('"msg": "stopping"' in line for line in running.output)
