"""Telemetry as operators get it: OTLP export from running services, and logs without secrets."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from toolmesh.client import RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh_testing import ServiceProcess, run_cli, start_host_process, start_service_process

pytestmark = pytest.mark.asyncio(loop_scope="module")

SECRET = "s3cr3t-value-9f2c7d"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver: what a collector would get."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []

    async def Export(self, request: Any, context: Any) -> Any:
        for resource_spans in request.resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"),
                "",
            )
            for scope in resource_spans.scope_spans:
                self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def receiver() -> AsyncIterator[tuple[Receiver, int]]:
    server = grpc.aio.server()
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield sink, port
    await server.stop(0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def services(
    receiver: tuple[Receiver, int], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[dict[str, Any]]:
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver[1]}",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_METRICS_EXPORTER="none",
        TOOLMESH_LOG_LEVEL="DEBUG",
    )
    processes: list[ServiceProcess] = []
    host = None
    try:
        registry = await start_service_process("registry", env=env)
        processes.append(registry)
        bridge = await start_service_process("bridge", env=env)
        processes.append(bridge)
        invocation = await start_service_process(
            "invocation", "--registry", registry.internal_target, "--bridge", bridge.internal_target, env=env
        )
        processes.append(invocation)
        env.update(
            TOOLMESH_REGISTRY_ADDR=registry.target,
            TOOLMESH_INVOCATION_ADDR=invocation.target,
            TOOLMESH_BRIDGE_ADDR=bridge.target,
        )
        async with RegistryClient(registry.target) as client:
            await client.put_tools(
                "exported",
                [
                    ToolSpec("echo", "", '{"type": "object"}'),
                    ToolSpec("domain_fail", "", '{"type": "object"}'),
                ],
            )
        markers = tmp_path_factory.mktemp("export-markers")
        host = await start_host_process(bridge.target, "exported", "e2e_handlers:HANDLERS", markers, env=env)
        yield {"env": env, "processes": processes, "host": host}
    finally:
        # Stop whatever started, even when the setup failed half way.
        if host is not None:
            await host.stop()
        for process in processes:
            await process.stop()


async def test_spans_of_a_call_reach_an_otlp_receiver(
    services: dict[str, Any], receiver: tuple[Receiver, int]
) -> None:
    code, out, err = await run_cli(
        "tool-call", "--thread-id", "exported", "--tool", "echo", "--args", '{"n": 1}', env=services["env"]
    )
    assert code == 0, err
    request_id = json.loads(out)["toolRequestId"]
    sink = receiver[0]

    def of_call() -> list[tuple[str, Any]]:
        found = []
        for service, span in sink.spans:
            attributes = {a.key: a.value.string_value for a in span.attributes}
            if attributes.get("toolmesh.tool_request_id") == request_id:
                found.append((service, span))
        return found

    expected = {"toolmesh-cli", "toolmesh-invocation", "toolmesh-bridge", "toolmesh-host"}
    for _ in range(100):
        if expected <= {service for service, _ in of_call()}:
            break
        await asyncio.sleep(0.1)
    spans = of_call()
    assert expected <= {service for service, _ in spans}, {service for service, _ in spans}
    assert len({span.trace_id for _, span in spans}) == 1
    # The registry is asked through a watched cache, not on every call; it exports its own spans.
    assert any(service == "toolmesh-registry" for service, _ in sink.spans)


async def test_arguments_and_results_are_never_logged(services: dict[str, Any], tmp_path: Path) -> None:
    env = services["env"]
    calls = [
        ("echo", {"password": SECRET, "nested": {"token": SECRET}}),
        ("domain_fail", {"secret": SECRET}),
        ("missing_tool", {"secret": SECRET}),
    ]
    outputs: list[str] = []
    request_ids: list[str] = []
    for tool, args in calls:
        code, out, err = await run_cli(
            "tool-call", "--thread-id", "exported", "--tool", tool, "--args", json.dumps(args), env=env
        )
        assert code == 0
        request_ids.append(json.loads(out)["toolRequestId"])
        outputs.append(err)
    assert SECRET in out or tool == "missing_tool"  # the caller does get its own data back
    await asyncio.sleep(0.5)
    outputs += ["".join(process.output) for process in services["processes"]]
    outputs += ["".join(services["host"].stderr_lines)]
    everything = "\n".join(outputs)
    assert SECRET not in everything
    # The logs did record these calls, with their correlation ids, at debug level.
    assert all(request_id in everything for request_id in request_ids[:3])
    assert '"level": "DEBUG"' in everything or '"level": "INFO"' in everything
