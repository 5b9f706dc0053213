"""A page's handler span: `ctx.traceContext` from the request, and an `execute_tool` span through the
page's @opentelemetry/api whose parent is the runtime's span that sent the request (Chromium)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from browser_driver import BrowserDriver, build_test_page
from spans import hear_in_process
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh_testing import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SPANS = InMemorySpanExporter()
SEEN = "window.toolmesh.seen"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def driver() -> AsyncIterator[BrowserDriver]:
    await asyncio.to_thread(build_test_page)
    running = await BrowserDriver.start()
    yield running
    await running.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system(driver: BrowserDriver) -> AsyncIterator[LocalSystem]:
    hear_in_process(SPANS)
    running = await start_local_system(heartbeat_s=0.3, web_origins=[driver.origins[0]])
    yield running
    await running.stop(0.2)


async def page_call(
    driver: BrowserDriver, system: LocalSystem, tab: str, session: str, tool: str, **query: str
) -> str:
    """Open the page for `session`, call `tool` once it is declared; the call's tool request id."""
    opened = await driver.open(tab, {"session": session, "baseUrl": system.web_url, **query})
    assert opened == {"started": True, "startError": ""}
    async with RegistryClient(system.registry_target) as registry:

        async def declared() -> bool:
            return registry_has(await registry.list_tools(session), tool)

        await eventually(declared)
    async with InvocationClient(system.invocation_target) as client:
        result = await client.invoke(
            session, tool, turn_id="turn-1", arguments_json=json.dumps({"text": "hi"})
        )
    assert result.tool_request_id is not None
    return result.tool_request_id


def registry_has(tools: Any, name: str) -> bool:
    return tools.find(name) is not None


def server_span(span_id: str) -> ReadableSpan | None:
    for span in SPANS.get_finished_spans():
        assert span.context is not None
        if f"{span.context.span_id:016x}" == span_id:
            return span
    return None


async def test_the_handler_span_is_a_child_of_the_span_that_sent_the_request(
    driver: BrowserDriver, system: LocalSystem
) -> None:
    request_id = await page_call(driver, system, "traced", "web-traced", "echo", traced="1")
    spans: list[dict[str, Any]] = await driver.eval("traced", "window.toolmesh.spans")
    (handler,) = [span for span in spans if span["name"] == "execute_tool echo"]
    assert handler["kind"] == 1 and handler["ended"]  # SERVER
    assert handler["attributes"]["gen_ai.tool.call.id"] == request_id
    assert handler["attributes"]["gen_ai.operation.name"] == "execute_tool"
    # Its parent is a span of the runtime's, in the invocation's trace.
    parent = await eventually(lambda: server_span(handler["parentSpanId"]), message="no such server span")
    assert parent.context is not None and f"{parent.context.trace_id:032x}" == handler["traceId"]
    executed = [
        s
        for s in SPANS.get_finished_spans()
        if s.name == "execute_tool echo"
        and s.attributes is not None
        and s.attributes.get("gen_ai.tool.call.id") == request_id
    ]
    assert [f"{s.context.trace_id:032x}" for s in executed if s.context is not None] == [handler["traceId"]]
    # The handler got the same trace context.
    (seen,) = [
        s for s in await driver.eval("traced", "window.toolmesh.seen") if s["toolRequestId"] == request_id
    ]
    assert seen["traceContext"]["traceparent"].split("-")[1:3] == [
        handler["traceId"],
        handler["parentSpanId"],
    ]


async def test_a_throwing_handler_marks_its_span_by_type(driver: BrowserDriver, system: LocalSystem) -> None:
    await page_call(driver, system, "boom", "web-traced-boom", "boom", traced="1")
    spans: list[dict[str, Any]] = await driver.eval("boom", "window.toolmesh.spans")
    (handler,) = [span for span in spans if span["name"] == "execute_tool boom"]
    assert handler["attributes"]["error.type"] == "TOOL_HANDLER_ERROR"
    assert handler["status"]["code"] == 2  # ERROR
    # By the exception's type, never its text (it quotes a password).
    assert handler["status"]["message"] == "RangeError"
    assert "hunter2" not in json.dumps(handler)


async def test_without_a_tracer_provider_there_is_no_span_but_the_context_is_given(
    driver: BrowserDriver, system: LocalSystem
) -> None:
    request_id = await page_call(driver, system, "plain", "web-untraced", "echo")
    assert await driver.eval("plain", "window.toolmesh.spans") == []
    (seen,) = [
        s for s in await driver.eval("plain", "window.toolmesh.seen") if s["toolRequestId"] == request_id
    ]
    assert seen["traceContext"]["traceparent"].startswith("00-")
