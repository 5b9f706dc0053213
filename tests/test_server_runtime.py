"""Standard services on every server, and a graceful stop on SIGTERM."""

from __future__ import annotations

import os

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from toolmesh.server.system import LocalSystem
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


@pytest.mark.parametrize("service", ["registry", "bridge"])
async def test_service_process_stops_gracefully_on_sigterm(service: str) -> None:
    running = await start_service_process(service, env=dict(os.environ))
    async with grpc.aio.insecure_channel(running.target) as channel:
        response = await health_check(channel)(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    await running.stop()
    assert running.process.returncode == 0
    assert any('"msg": "stopping"' in line for line in running.output)
