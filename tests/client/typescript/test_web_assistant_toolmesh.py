"""@toolmesh/assistant's toolmesh() channel in a real Chromium, against real services.

The page's assistant lists a session's tools through the registry and calls them through the
invocation service, both on the services' web port (Connect), with a caller token; the tools are
served by a Python host (toolmesh.host) in this process, and the model is a scripted
chat-completions server (tests/support/scripted_model.py). Calls go as RunTool streams (the
handler's progress reaches the widget); WatchTools tells the channel the tools moved while a
confirmation was open. Between the page and the web port, a proxy (tests/support/cutting_proxy.py)
cuts a call mid-way: the channel's exact retry joins or replays the invocation, and the handler
runs once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio

from assistant_page import PAGE, Page
from browser_driver import BrowserDriver, build_test_page
from cutting_proxy import CuttingProxy, cutting_proxy
from scripted_model import ScriptedModel, Step, answer, before, running_model, tool_calls
from toolmesh.assembly.system import (
    LocalSystem,
    start_bridge,
    start_invocation,
    start_local_system,
    start_registry,
)
from toolmesh.assistant.errors import TURN_TABLE, TurnCode
from toolmesh.auth.tokens import SharedSecret, Verifier
from toolmesh.client import RegistryClient
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh.runtime.security import Security
from toolmesh_testing import eventually
from trust_testing import SECRET, token

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "page-assistant"
OBJECT = json.dumps({"type": "object", "properties": {"q": {"type": "string"}}})
SPECS = [
    ToolSpec("lookup", "Look a word up.", OBJECT, timeout_ms=20_000),
    ToolSpec("gated", "Works until the test lets it finish.", OBJECT, timeout_ms=20_000),
    ToolSpec(
        "wipe",
        "Remove every note.",
        timeout_ms=20_000,
        annotations=ToolAnnotations(requires_confirmation=True),
    ),
]
EXTRA = ToolSpec("extra", "A tool declared while the assistant works.")


@dataclass
class Handlers:
    """The Python host's handlers: how often each ran, and the gate `gated` waits at."""

    runs: dict[str, int] = field(default_factory=lambda: {"lookup": 0, "gated": 0, "wipe": 0})
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: int = 0

    def reset(self) -> None:
        self.runs = dict.fromkeys(self.runs, 0)
        self.gate, self.entered, self.cancelled = asyncio.Event(), asyncio.Event(), 0

    async def lookup(self, args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        self.runs["lookup"] += 1
        return {"word": args.get("q", ""), "meaning": "a small note"}

    async def gated(self, args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        self.runs["gated"] += 1
        await ctx.report_progress(1, 4, "step 1")
        self.entered.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return {"finished": args.get("q", "")}

    async def wipe(self, args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        self.runs["wipe"] += 1
        return {"wiped": True}


@dataclass
class Stack:
    system: LocalSystem
    host: ToolHost
    handlers: Handlers
    registry: RegistryClient

    async def revision(self) -> int:
        return (await self.registry.list_tools(SESSION)).revision

    async def move_tools(self, tools: list[ToolSpec]) -> None:
        """Declare `tools` from the host and wait until the registry's revision has moved."""
        before_move = await self.revision()
        await self.host.declare_tools(tools)

        async def moved() -> bool:
            return await self.revision() != before_move

        await eventually(moved)


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


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(driver: BrowserDriver) -> AsyncIterator[Stack]:
    system = await start_local_system(
        web_origins=[driver.origins[0]], security=Security(verifier=Verifier(SharedSecret(SECRET)))
    )
    handlers = Handlers()
    host = ToolHost(system.bridge_target, SESSION, token=token("host", SESSION))
    for name in handlers.runs:
        host.on_tool(name, getattr(handlers, name))
    host.on_tool(EXTRA.name, handlers.lookup)
    await host.declare_tools(SPECS)
    await host.start()
    registry = RegistryClient(system.registry_target, token=token("call", SESSION))
    running = Stack(system, host, handlers, registry)
    await eventually(running.revision)
    yield running
    await registry.close()
    await host.stop()
    await system.stop(0.5)


@pytest_asyncio.fixture(loop_scope="module")
async def fresh(stack: Stack) -> AsyncIterator[Stack]:
    """The stack with the handlers' counts at zero and the session's tools as SPECS."""
    stack.handlers.reset()
    if {tool.name for tool in (await stack.registry.list_tools(SESSION)).tools} != {s.name for s in SPECS}:
        await stack.move_tools(SPECS)
    yield stack
    stack.handlers.gate.set()


_tabs = iter(range(1 << 30))


async def open_page(
    driver: BrowserDriver,
    model: ScriptedModel,
    base_url: str,
    *steps: Step,
    protocol: str = "connect",
    registry_url: str = "",
) -> Page:
    model.script(*steps)
    tab = f"t{next(_tabs)}"
    query = {
        "model": model.url,
        "baseUrl": base_url,
        "session": SESSION,
        "token": token("call", SESSION),
        "protocol": protocol,
        **({"registryUrl": registry_url} if registry_url else {}),
    }
    opened = await driver.open(tab, query, path="/assistant")
    assert opened["started"], opened
    return Page(driver, tab)


def offered(model: ScriptedModel, request: int) -> set[str]:
    return {tool["function"]["name"] for tool in model.requests[request]["tools"]}


async def test_a_python_hosts_tool_answers_in_the_widget(
    driver: BrowserDriver, model: ScriptedModel, fresh: Stack
) -> None:
    page = await open_page(
        driver,
        model,
        fresh.system.web_url,
        tool_calls(("lookup", {"q": "memo"})),
        answer("A memo is a note."),
    )
    assert await page.outcome(await page.send("what is a memo?")) == {"answer": "A memo is a note."}
    [result] = await page.tool_results()
    assert result["ok"] and result["data"] == {"word": "memo", "meaning": "a small note"}
    assert fresh.handlers.runs["lookup"] == 1
    assert offered(model, 0) == {"lookup", "gated", "wipe"}
    # The model read the host's result in the same turn.
    [seen] = model.tool_messages(1)
    assert json.loads(seen["content"]) == {"word": "memo", "meaning": "a small note"}
    assert "A memo is a note." in await page.eval(f"{PAGE}.log()")
    assert await page.eval(f"{PAGE}.alertHidden()")


async def test_stale_tools_when_the_revision_moves_between_planning_and_the_call(
    driver: BrowserDriver, model: ScriptedModel, fresh: Stack
) -> None:
    page = await open_page(
        driver,
        model,
        fresh.system.web_url,
        before(lambda: fresh.move_tools([*SPECS, EXTRA]), tool_calls(("lookup", {"q": "x"}))),
        answer("The tools changed."),
    )
    assert await page.outcome(await page.send("look x up")) == {"answer": "The tools changed."}
    assert [r["code"] for r in await page.tool_results()] == ["STALE_TOOLS"]
    assert fresh.handlers.runs["lookup"] == 0
    # The next round planned on the refreshed list.
    assert "extra" in offered(model, 1) and "extra" not in offered(model, 0)
    assert f"STALE_TOOLS {TURN_TABLE[TurnCode.STALE_TOOLS].message}" in await page.eval(f"{PAGE}.log()")


# Server-streaming from the page (WatchTools, RunTool) over both protocols of the web port.
PROTOCOLS = pytest.mark.parametrize("protocol", ["connect", "grpc-web"])


@PROTOCOLS
async def test_the_watch_withdraws_a_confirmation_when_the_tools_move(
    driver: BrowserDriver, model: ScriptedModel, fresh: Stack, protocol: str
) -> None:
    page = await open_page(
        driver,
        model,
        fresh.system.web_url,
        tool_calls(("wipe", {})),
        answer("Not wiped: the tools changed."),
        protocol=protocol,
    )
    index = await page.send("wipe everything")
    await page.wait(f"{PAGE}.dialogOpen()")
    await page.shot("confirmation")
    # WatchTools (server-streaming over Connect, from the page) hears of the move.
    await fresh.move_tools([*SPECS, EXTRA])
    assert await page.outcome(index) == {"answer": "Not wiped: the tools changed."}
    assert not await page.eval(f"{PAGE}.dialogOpen()")
    assert [r["code"] for r in await page.tool_results()] == ["STALE_TOOLS"]
    assert fresh.handlers.runs["wipe"] == 0
    assert "extra" in offered(model, 1)


@PROTOCOLS
async def test_run_tool_progress_shows_in_the_widget_as_the_call_runs(
    driver: BrowserDriver, model: ScriptedModel, fresh: Stack, protocol: str
) -> None:
    page = await open_page(
        driver,
        model,
        fresh.system.web_url,
        tool_calls(("gated", {"q": "p"})),
        answer("Finished."),
        protocol=protocol,
    )
    index = await page.send("work")
    await page.wait(f"{PAGE}.progress()[1] === 1")
    text, value, maximum, hidden = await page.eval(f"{PAGE}.progress()")
    assert (text, value, maximum, hidden) == ("Running gated… (1 of 4: step 1)", 1, 4, False)
    assert await driver.axe(page.tab) == []
    await page.shot("running-tool")
    fresh.handlers.gate.set()
    assert await page.outcome(index) == {"answer": "Finished."}
    assert (await page.eval(f"{PAGE}.progress()"))[3] is True  # the bar goes with the call
    assert fresh.handlers.runs["gated"] == 1


async def test_stop_cancels_the_invocation_on_the_python_host(
    driver: BrowserDriver, model: ScriptedModel, fresh: Stack
) -> None:
    page = await open_page(driver, model, fresh.system.web_url, tool_calls(("gated", {"q": "stop"})))
    index = await page.send("work, then stop")
    # The progress shown: the page has the invocation's id (RunTool's first event) by then.
    await page.wait(f"{PAGE}.progress()[1] === 1")
    await page.eval(f"{PAGE}.stop()")
    assert await page.outcome(index) == {"code": "ABORTED"}
    await eventually(lambda: fresh.handlers.cancelled == 1)


@pytest_asyncio.fixture(loop_scope="module")
async def proxy(fresh: Stack) -> AsyncIterator[CuttingProxy]:
    assert fresh.system.bridge.web_port is not None
    async with cutting_proxy(fresh.system.bridge.web_port) as running:
        yield running


async def test_a_call_cut_while_the_tool_runs_is_joined_by_its_exact_retry(
    driver: BrowserDriver, model: ScriptedModel, fresh: Stack, proxy: CuttingProxy
) -> None:
    page = await open_page(
        driver, model, proxy.url, tool_calls(("gated", {"q": "join"})), answer("Done once.")
    )
    index = await page.send("work")
    await fresh.handlers.entered.wait()
    assert proxy.cut() == 1
    # The exact retry reached the service (a new RunTool call) and joined the running invocation.
    await eventually(lambda: proxy.calls == 2)
    fresh.handlers.gate.set()
    assert await page.outcome(index) == {"answer": "Done once."}
    assert fresh.handlers.runs["gated"] == 1
    assert await page.eval(f"{PAGE}.runToolRequests.length") == 2  # the call and its exact retry
    [result] = await page.tool_results()
    assert result["ok"] and result["data"] == {"finished": "join"}
    assert json.loads(model.tool_messages(1)[0]["content"]) == {"finished": "join"}


async def test_an_outcome_lost_on_the_way_is_replayed_to_the_exact_retry(
    driver: BrowserDriver, model: ScriptedModel, fresh: Stack, proxy: CuttingProxy
) -> None:
    page = await open_page(
        driver, model, proxy.url, tool_calls(("lookup", {"q": "lost"})), answer("Replayed.")
    )
    proxy.swallow_next_call()
    index = await page.send("look it up")
    # The tool ran and its outcome was sent, but the page never got it.
    await eventually(lambda: b'"outcome"' in proxy.swallowed)
    assert fresh.handlers.runs["lookup"] == 1
    assert proxy.cut() == 1
    assert await page.outcome(index) == {"answer": "Replayed."}
    assert fresh.handlers.runs["lookup"] == 1
    assert await page.eval(f"{PAGE}.runToolRequests.length") == 2
    assert json.loads(model.tool_messages(1)[0]["content"]) == {"word": "lost", "meaning": "a small note"}


async def test_the_retry_gives_up_with_a_typed_result(
    driver: BrowserDriver, model: ScriptedModel, fresh: Stack, proxy: CuttingProxy
) -> None:
    page = await open_page(
        driver, model, proxy.url, tool_calls(("lookup", {"q": "never"})), answer("It did not get through.")
    )
    proxy.drop_calls = True
    assert await page.outcome(await page.send("look it up")) == {"answer": "It did not get through."}
    [result] = await page.tool_results()
    assert result["code"] == "EXECUTION_FAILED" and result["cause"] == "TRANSPORT_FAILED"
    # The channel's three attempts (Chromium may itself send one again on a kept-alive
    # connection that closed before any answer: the proxy may count more).
    assert await page.eval(f"{PAGE}.runToolRequests.length") == 3 and proxy.calls >= 3
    assert "No outcome arrived after 3 attempts (TRANSPORT_FAILED)" in result["text"]
    assert fresh.handlers.runs["lookup"] == 0


async def test_the_standalone_services_web_ports_serve_the_page(
    driver: BrowserDriver, model: ScriptedModel
) -> None:
    """The registry and the invocation service apart, each on a web port of its own (`--web-listen`)."""
    security = Security(verifier=Verifier(SharedSecret(SECRET))).with_service_token()
    origins = [driver.origins[0]]
    registry = await start_registry(security=security, web_address="127.0.0.1:0", web_origins=origins)
    bridge, _ = await start_bridge(registry_target=f"127.0.0.1:{registry.internal_port}", security=security)
    invocation = await start_invocation(
        f"127.0.0.1:{registry.internal_port}",
        f"127.0.0.1:{bridge.internal_port}",
        security=security,
        web_address="127.0.0.1:0",
        web_origins=origins,
    )
    handlers = Handlers()
    host = ToolHost(f"127.0.0.1:{bridge.port}", SESSION, token=token("host", SESSION))
    host.on_tool("lookup", handlers.lookup, description="Look a word up.", input_schema=json.loads(OBJECT))
    await host.start()
    try:
        page = await open_page(
            driver,
            model,
            f"http://127.0.0.1:{invocation.web_port}",
            tool_calls(("lookup", {"q": "apart"})),
            answer("Served apart."),
            registry_url=f"http://127.0.0.1:{registry.web_port}",
        )
        assert await page.outcome(await page.send("look it up")) == {"answer": "Served apart."}
        assert handlers.runs["lookup"] == 1
        assert json.loads(model.tool_messages(1)[0]["content"]) == {
            "word": "apart",
            "meaning": "a small note",
        }
    finally:
        await host.stop()
        for server in (invocation, bridge, registry):
            await server.stop(0.2)
