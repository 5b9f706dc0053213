"""The page assistant's toolmesh() calls in the turn's trace (Chromium, real services): each call
is an `execute_tool {tool}` span of the page's, child of the turn's `invoke_agent` span, and every
RunTool attempt sends that span's W3C context, so the services' spans of the call (the web port's,
the invocation's, the Python host's handler span) are its descendants in the same trace."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from assistant_page import PAGE, Page
from browser_driver import BrowserDriver, build_test_page
from scripted_model import ScriptedModel, answer, running_model, tool_calls
from spans import hear_in_process
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh_testing import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "page-assistant-traced"
OBJECT = json.dumps({"type": "object", "properties": {"q": {"type": "string"}}})
SPANS = InMemorySpanExporter()
# In the person's text and the tool's arguments and result: never on a span.
MARKER = "marker-2c9e"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def driver() -> AsyncIterator[BrowserDriver]:
    await asyncio.to_thread(build_test_page, "assistant-test")
    started = await BrowserDriver.start()
    yield started
    await started.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def model() -> AsyncIterator[ScriptedModel]:
    async with running_model(cors=True) as server:
        yield server


async def lookup(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"word": args.get("q", ""), "meaning": MARKER}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system(driver: BrowserDriver) -> AsyncIterator[LocalSystem]:
    hear_in_process(SPANS)
    running = await start_local_system(web_origins=[driver.origins[0]])
    host = ToolHost(running.bridge_target, SESSION)
    host.on_tool("lookup", lookup)
    await host.declare_tools([ToolSpec("lookup", "Look a word up.", OBJECT, timeout_ms=20_000)])
    await host.start()
    async with RegistryClient(running.registry_target) as registry:

        async def declared() -> bool:
            return (await registry.list_tools(SESSION)).find("lookup") is not None

        await eventually(declared)
    yield running
    await host.stop()
    await running.stop(0.2)


def hex_ids(span: ReadableSpan) -> tuple[str, str, str]:
    """(trace id, span id, parent span id) of a server span, as the page writes them."""
    assert span.context is not None
    parent = f"{span.parent.span_id:016x}" if span.parent is not None else ""
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}", parent


async def test_a_toolmesh_call_is_an_execute_tool_span_the_services_spans_descend_from(
    driver: BrowserDriver, model: ScriptedModel, system: LocalSystem
) -> None:
    model.script(tool_calls(("lookup", {"q": MARKER})), answer(f"It means {MARKER}."))
    query = {"model": model.url, "baseUrl": system.web_url, "session": SESSION, "traced": "1"}
    opened = await driver.open("traced", query, path="/assistant")
    assert opened["started"], opened
    page = Page(driver, "traced")
    assert await page.outcome(await page.send(f"what is {MARKER}?")) == {"answer": f"It means {MARKER}."}
    found: list[dict[str, Any]] = await page.eval(f"{PAGE}.spans")
    (turn,) = [span for span in found if span["name"] == "invoke_agent"]
    (tool,) = [span for span in found if span["name"] == "execute_tool lookup"]
    assert tool["kind"] == 0 and tool["ended"]  # INTERNAL
    assert (tool["traceId"], tool["parentSpanId"]) == (turn["traceId"], turn["spanId"])
    assert tool["attributes"] == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "lookup",
        "gen_ai.tool.call.id": "call_0",
        "gen_ai.tool.type": "function",
        "toolmesh.turn_id": turn["attributes"]["toolmesh.turn_id"],
    }
    assert tool["status"]["code"] == 0

    # The web port's span of the RunTool request is the page span's child.
    def run_tool_span() -> ReadableSpan | None:
        for span in SPANS.get_finished_spans():
            if span.name.endswith("RunTool") and hex_ids(span)[2] == tool["spanId"]:
                return span
        return None

    served = await eventually(run_tool_span, message="no RunTool span under the page's span")
    assert hex_ids(served)[0] == tool["traceId"]

    # The Python host's handler span is in the same trace.
    def handler_span() -> ReadableSpan | None:
        for span in SPANS.get_finished_spans():
            if span.name == "execute_tool lookup" and hex_ids(span)[0] == tool["traceId"]:
                return span
        return None

    await eventually(handler_span, message="the host's handler span is not in the page's trace")
    in_trace = [s for s in SPANS.get_finished_spans() if hex_ids(s)[0] == tool["traceId"]]
    assert MARKER not in json.dumps([dict(s.attributes or {}) for s in in_trace])
    assert MARKER not in json.dumps(found)


async def test_without_a_tracer_provider_a_toolmesh_call_sends_no_trace_context(
    driver: BrowserDriver, model: ScriptedModel, system: LocalSystem
) -> None:
    model.script(tool_calls(("lookup", {"q": "plain"})), answer("Done."))
    query = {"model": model.url, "baseUrl": system.web_url, "session": SESSION}
    opened = await driver.open("plain", query, path="/assistant")
    assert opened["started"], opened
    page = Page(driver, "plain")
    known = {hex_ids(s)[0] for s in SPANS.get_finished_spans()}
    assert await page.outcome(await page.send("look plain up")) == {"answer": "Done."}
    assert await page.eval(f"{PAGE}.spans") == []
    # The services' spans of this call start a trace of their own: no parent from the page.

    def fresh_run_tool() -> ReadableSpan | None:
        for span in SPANS.get_finished_spans():
            if span.name.endswith("RunTool") and hex_ids(span)[0] not in known:
                return span
        return None

    served = await eventually(fresh_run_tool, message="no RunTool span for the untraced call")
    assert served.parent is None or not served.parent.is_remote
