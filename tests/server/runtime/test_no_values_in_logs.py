"""No argument or result value reaches a log line or a span, exception text included.

Every value below holds MARKER: handlers that raise with it in their message,
arguments that break the schema with it, results that break the outputSchema
with it, unparsable arguments around it, and raw bytes holding it sent to every
method. The marker must appear in no log record (in-process, at DEBUG), in no
line the service processes write on stderr (at DEBUG), and in no exported span.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from spans import EXPORTER as TRACING_EXPORTER
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core import otel
from toolmesh.core.errors import Code
from toolmesh.core.tools import ToolSpec
from toolmesh.host import HostError, ToolContext, ToolHost
from toolmesh.runtime.server import Service, start_server
from toolmesh.v1 import bridge_pb2, invocation_pb2, registry_pb2, registry_pb2_grpc
from toolmesh_testing import ServiceProcess, eventually, start_service_process

MARKER = "zq-secret-7f3a91"
SESSION = "values-stay-out"
EXPORTER = InMemorySpanExporter()

TOOLS = [
    ToolSpec("explode", timeout_ms=5_000),
    ToolSpec(
        "strict",
        input_schema_json='{"type": "object", "properties": {"amount": {"type": "integer", "maximum": 100}}}',
        timeout_ms=5_000,
    ),
    ToolSpec(
        "shaped",
        output_schema_json='{"type": "object", "properties": {"x": {"type": "integer"}}}',
        timeout_ms=5_000,
    ),
    ToolSpec("echo", timeout_ms=5_000),
]


def explode(args: dict[str, Any], ctx: ToolContext) -> None:
    raise ValueError(f"could not handle {MARKER}: {args}")


def shaped(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"x": MARKER}


def echo(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"echoed": args}


def report_badly(error: HostError) -> None:
    raise RuntimeError(f"the error callback failed over {MARKER}")


def tracing() -> InMemorySpanExporter:
    """Spans of this process into EXPORTER as well, whichever module installs the SDK first.

    The tracer provider is installed once per process: when this module comes first, it
    installs it as test_tracing would, with the process's one exporter (spans.EXPORTER) (its metric reader
    it installs itself).
    """
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        otel.configure("toolmesh-test", span_processors=[SimpleSpanProcessor(TRACING_EXPORTER)])
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    if not _added:
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        _added.append(EXPORTER)
    return EXPORTER


_added: list[InMemorySpanExporter] = []


def marked_records(records: Iterable[logging.LogRecord]) -> list[str]:
    """The records that mention MARKER anywhere: message, fields, or exception and its chain."""
    found = []
    formatter = logging.Formatter()
    for record in records:
        text = record.getMessage() + repr(record.__dict__)
        if record.exc_info:
            text += formatter.formatException(record.exc_info)
        if MARKER in text:
            found.append(text)
    return found


def marked_spans(spans: Iterable[ReadableSpan]) -> list[str]:
    found = []
    for span in spans:
        text = repr(
            (
                span.name,
                dict(span.attributes or {}),
                span.status.description,
                [(event.name, dict(event.attributes or {})) for event in span.events],
            )
        )
        if MARKER in text:
            found.append(text)
    return found


async def drive_calls(invocation_target: str, registry_target: str, bridge_target: str) -> None:
    """Every kind of failing call, with MARKER in the values; checks each failed as it should."""
    async with RegistryClient(registry_target) as registry:
        await registry.put_tools(SESSION, TOOLS)
    host = ToolHost(bridge_target, SESSION)
    host.on_tool("explode", explode)
    host.on_tool("shaped", shaped)
    host.on_tool("echo", echo)
    host.on_error(report_badly)
    await host.start()
    try:
        async with InvocationClient(invocation_target) as client:
            exploded = await client.invoke(SESSION, "explode", {"note": MARKER}, turn_id="t")
            assert exploded.outcome and exploded.outcome.failure
            assert exploded.outcome.failure.code == Code.TOOL_HANDLER_ERROR.value
            refused = await client.invoke(SESSION, "strict", {"amount": MARKER}, turn_id="t")
            assert refused.code is Code.TOOL_ARGS_INVALID or (
                refused.outcome
                and refused.outcome.failure
                and refused.outcome.failure.code == Code.TOOL_ARGS_INVALID.value
            )
            broken = await client.invoke(SESSION, "shaped", {}, turn_id="t")
            assert broken.outcome and broken.outcome.failure
            assert broken.outcome.failure.code == Code.TOOL_RESULT_INVALID.value
            echoed = await client.invoke(SESSION, "echo", {"note": MARKER}, turn_id="t")
            assert echoed.outcome and echoed.outcome.result_json and MARKER in echoed.outcome.result_json
        async with grpc.aio.insecure_channel(invocation_target) as channel:
            invoke = channel.unary_unary(
                "/toolmesh.v1.InvocationService/InvokeTool",
                request_serializer=invocation_pb2.InvokeToolRequest.SerializeToString,
                response_deserializer=invocation_pb2.InvokeToolResponse.FromString,
            )
            for arguments in (f'{{"note": "{MARKER}', f'["{MARKER}"]', f'{{"note": "{MARKER}\\ud800"}}'):
                request = invocation_pb2.InvokeToolRequest(
                    session_id=SESSION, turn_id="t", tool_name="echo", arguments_json=arguments
                )
                response = await invoke(request, timeout=10)
                assert response.outcome.WhichOneof("outcome") == "error", response
    finally:
        await host.stop()


async def send_raw_bytes(target: str) -> None:
    """Bytes holding MARKER, as the request of every toolmesh method, unary or streaming."""
    payloads = [MARKER.encode(), b"\x0a" + bytes([len(MARKER)]) + MARKER.encode() + b"\xff\xfe"]
    async with grpc.aio.insecure_channel(target) as channel:
        for module in (registry_pb2, invocation_pb2, bridge_pb2):
            for service in module.DESCRIPTOR.services_by_name.values():
                for method in service.methods:
                    path = f"/{service.full_name}/{method.name}"
                    for payload in payloads:
                        await _send(channel, path, method.client_streaming, method.server_streaming, payload)


async def _send(
    channel: grpc.aio.Channel, path: str, client_streaming: bool, server_streaming: bool, payload: bytes
) -> None:
    def identity(raw: bytes) -> bytes:
        return raw

    try:
        if client_streaming:
            call: Any = channel.stream_stream(path, identity, identity)(iter([payload]), timeout=2)
            async for _ in call:
                pass
        elif server_streaming:
            async for _ in channel.unary_stream(path, identity, identity)(payload, timeout=2):
                pass
        else:
            await channel.unary_unary(path, identity, identity)(payload, timeout=2)
    except grpc.aio.AioRpcError as error:
        assert MARKER not in (error.details() or "")


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="function")
async def test_in_process_logs_and_spans_hold_no_value(caplog: pytest.LogCaptureFixture) -> None:
    from toolmesh.assembly.system import start_local_system  # noqa: PLC0415

    exporter = tracing()
    caplog.set_level(logging.DEBUG)
    system = await start_local_system(heartbeat_s=0.5)
    try:
        await drive_calls(system.invocation_target, system.registry_target, system.bridge_target)
        await send_raw_bytes(system.invocation_target)
        await send_raw_bytes(system.registry_target)
        await send_raw_bytes(system.bridge_target)
    finally:
        await system.stop(0.5)
    # The failures happened and were logged (by type), without the values.
    assert any(r.getMessage() == "tool handler raised" for r in caplog.records)
    assert any(r.getMessage() == "on_error callback raised" for r in caplog.records)
    assert marked_records(caplog.records) == []
    assert exporter.get_finished_spans()
    assert marked_spans(exporter.get_finished_spans()) == []


class Raising:
    """A servicer whose every method fails with an exception that quotes the request."""

    async def ListTools(self, request: Any, context: Any) -> Any:
        raise ValueError(f"cannot list {request.session_id}")

    async def GetTool(self, request: Any, context: Any) -> Any:
        raise ValueError(f"cannot get {request}")

    async def PutTools(self, request: Any, context: Any) -> Any:
        raise ValueError(f"cannot put {request}")

    async def WatchTools(self, request: Any, context: Any) -> Any:
        raise KeyError(f"cannot watch {request.session_id}")
        yield  # a generator, as a streaming method is


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="function")
async def test_unexpected_errors_are_internal_and_logged_by_type(caplog: pytest.LogCaptureFixture) -> None:
    """The servicer wrapper's answer to an exception it did not expect: INTERNAL, no text."""
    exporter = tracing()
    caplog.set_level(logging.DEBUG)
    service = Service(
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
        Raising(),
        registry_pb2_grpc.add_RegistryServiceServicer_to_server,
    )
    server = await start_server([service])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as listed:
                await stub.ListTools(registry_pb2.ListToolsRequest(session_id=MARKER), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as watched:
                async for _ in stub.WatchTools(registry_pb2.WatchToolsRequest(session_id=MARKER), timeout=5):
                    pass
    finally:
        await server.stop(0)
    for failed in (listed.value, watched.value):
        assert failed.code() == grpc.StatusCode.INTERNAL
        assert MARKER not in (failed.details() or "")
    unexpected = [r for r in caplog.records if r.getMessage() == "unexpected error"]
    assert {getattr(r, "exception", None) for r in unexpected} == {"ValueError", "KeyError"}
    assert all(getattr(r, "code", None) == "INTERNAL" for r in unexpected)
    assert marked_records(caplog.records) == []
    assert marked_spans(exporter.get_finished_spans()) == []


@pytest_asyncio.fixture
async def service_processes() -> AsyncIterator[list[ServiceProcess]]:
    prefix = new_prefix()
    store = ["--store", SHARED_URL, "--store-prefix", prefix]
    env = dict(os.environ, TOOLMESH_LOG_LEVEL="DEBUG")
    registry, bridge = await asyncio.gather(
        *(start_service_process(name, *store, env=env) for name in ("registry", "bridge"))
    )
    dependencies = ["--registry", registry.internal_target, "--bridge", bridge.internal_target]
    invocation = await start_service_process("invocation", *dependencies, *store, env=env)
    processes = [registry, bridge, invocation]
    yield processes
    for process in processes:
        await process.stop()
    await delete_prefixed(SHARED_URL, prefix)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="function")
async def test_service_processes_write_no_value_on_stderr(service_processes: list[ServiceProcess]) -> None:
    registry, bridge, invocation = service_processes
    await drive_calls(invocation.target, registry.target, bridge.target)
    for process in service_processes:
        await send_raw_bytes(process.target)
    for internal in (registry, bridge):
        await send_raw_bytes(internal.internal_target)
    # The processes did log at DEBUG meanwhile (a dispatch, the refused bytes).
    await eventually(lambda: any('"undecodable request refused"' in line for line in bridge.output))
    for process in service_processes:
        await process.stop()
    lines = [line for process in service_processes for line in process.output]
    assert any(json.loads(line).get("level") == "DEBUG" for line in lines if line.startswith("{"))
    assert [line for line in lines if MARKER in line] == []


@pytest.mark.unit
def test_json_lines_render_a_library_traceback_without_its_text() -> None:
    """A library that logs an exception (asyncio does, with its repr) gets frames and types only."""
    from toolmesh.core.logs import JsonFormatter  # noqa: PLC0415

    try:
        try:
            raise KeyError(MARKER)
        except KeyError as inner:
            raise ValueError(f"over {MARKER}") from inner
    except ValueError as outer:
        record = logging.LogRecord(
            "asyncio",
            logging.ERROR,
            __file__,
            1,
            "Task exception was never retrieved\nfuture: %r",
            (outer,),
            (type(outer), outer, outer.__traceback__),
        )
    line = json.loads(JsonFormatter("test").format(record))
    assert MARKER not in json.dumps(line)
    assert line["msg"] == "Task exception was never retrieved"
    assert line["exception"] == "ValueError"
    assert "KeyError" in line["traceback"] and "test_json_lines_render" in line["traceback"]
