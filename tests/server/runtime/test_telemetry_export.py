"""Telemetry as operators get it: OTLP export from running services, and logs without secrets."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from spans import Receiver, otlp_receiver
from toolmesh.client import RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh_testing import ServiceProcess, eventually, run_cli, start_host_process, start_service_process

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SECRET = "s3cr3t-value-9f2c7d"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def receiver() -> AsyncIterator[tuple[Receiver, int]]:
    async with otlp_receiver() as running:
        yield running


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
    await eventually(lambda: expected <= {service for service, _ in of_call()})
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
    cli_errors: list[str] = []
    request_ids: list[str] = []
    for tool, args in calls:
        code, out, err = await run_cli(
            "tool-call", "--thread-id", "exported", "--tool", tool, "--args", json.dumps(args), env=env
        )
        assert code == 0
        request_id = json.loads(out)["toolRequestId"]
        if tool == "missing_tool":
            assert request_id is None  # refused before it ran: no invocation, no id
        else:
            request_ids.append(request_id)
        cli_errors.append(err)
        if tool == "echo":
            assert SECRET in out  # the caller does get its own data back: the secret did travel

    def logs() -> list[str]:
        return [
            *cli_errors,
            *("".join(process.output) for process in services["processes"]),
            "".join(services["host"].stderr_lines),
        ]

    def levels_by_request() -> dict[str, set[str]]:
        """The levels of the JSON log records about each call, by tool request id."""
        levels: dict[str, set[str]] = {}
        for line in "\n".join(logs()).splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and "tool_request_id" in record:
                    levels.setdefault(record["tool_request_id"], set()).add(record["level"])
        return levels

    # The logs record every call with its correlation ids; those that ran, at debug level.
    await eventually(lambda: set(request_ids) <= set(levels_by_request()))
    levels = levels_by_request()
    assert all("DEBUG" in levels[request_id] for request_id in request_ids[:2]), levels
    assert SECRET not in "\n".join(logs())
