"""Pages as handler hosts: the TypeScript SDK in a real Chromium, over the bridge's web port.

The page is built from clients/typescript by esbuild and driven by
playwright-core on Debian's /usr/bin/chromium; the calls come from the Python
client and CLI through the real registry, invocation and bridge servers.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio

from bench.procs import free_port
from browser_driver import BrowserDriver, build_test_page
from toolmesh.assembly.system import start_bridge, start_invocation, start_registry
from toolmesh.client import CallResult, InvocationClient, RegistryClient, ToolProgress
from toolmesh.core.errors import Code
from toolmesh.core.outcome import ErrorKind
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.runtime.server import RunningServer
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc
from toolmesh_testing import dispatch_together, eventually, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


@dataclass
class WebStack:
    """Registry, bridge (with its web port) and invocation, each restartable on its own port."""

    registry: RunningServer
    bridge: RunningServer
    invocation: RunningServer
    registry_port: int
    bridge_port: int
    web_port: int
    origins: list[str]
    # The bridge's internal listener, where the invocation service dispatches.
    bridge_internal_port: int

    @property
    def registry_target(self) -> str:
        return f"127.0.0.1:{self.registry_port}"

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    @classmethod
    async def start(cls, origins: list[str]) -> WebStack:
        """Every server on a free port below the ephemeral range (no outgoing connection takes one
        while its server restarts), kept for the restarts."""
        registry = await start_registry(f"127.0.0.1:{free_port()}")
        bridge = await cls._bridge(free_port(), free_port(), registry.port, origins, free_port())
        assert bridge.web_port is not None and bridge.internal is not None
        invocation = await start_invocation(f"127.0.0.1:{registry.port}", f"127.0.0.1:{bridge.internal_port}")
        return cls(
            registry,
            bridge,
            invocation,
            registry.port,
            bridge.port,
            bridge.web_port,
            origins,
            bridge.internal_port,
        )

    @staticmethod
    async def _bridge(
        port: int, web_port: int, registry_port: int, origins: list[str], internal_port: int
    ) -> RunningServer:
        # The registry's public port serves the lists the bridge keeps (no tokens here).
        server, _ = await start_bridge(
            f"127.0.0.1:{port}",
            heartbeat_s=0.3,
            registry_target=f"127.0.0.1:{registry_port}",
            web_address=f"127.0.0.1:{web_port}",
            web_origins=origins,
            internal_address=f"127.0.0.1:{internal_port}",
        )
        return server

    async def restart_bridge(self) -> None:
        await self.bridge.stop(0.2)
        self.bridge = await self._bridge(
            self.bridge_port, self.web_port, self.registry_port, self.origins, self.bridge_internal_port
        )

    async def restart_registry(self) -> None:
        """A new, empty registry on the same port: what a restart of the embedded default is."""
        await self.registry.stop(0.2)
        self.registry = await start_registry(self.registry_target)

    async def stop(self) -> None:
        for server in (self.invocation, self.bridge, self.registry):
            await server.stop(0.2)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def driver() -> AsyncIterator[BrowserDriver]:
    await asyncio.to_thread(build_test_page)
    running = await BrowserDriver.start()
    yield running
    await running.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(driver: BrowserDriver) -> AsyncIterator[WebStack]:
    # Only the driver's first origin is allowed; its second one is not.
    running = await WebStack.start([driver.origins[0]])
    yield running
    await running.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(stack: WebStack) -> AsyncIterator[InvocationClient]:
    async with InvocationClient(f"127.0.0.1:{stack.invocation.port}") as invocation:
        yield invocation


async def open_page(
    driver: BrowserDriver, stack: WebStack, tab: str, session: str, *, webmcp: bool = False, **query: str
) -> None:
    opened = await driver.open(tab, {"session": session, "baseUrl": stack.web_url, **query}, webmcp=webmcp)
    assert opened == {"started": True, "startError": ""}


async def tools_of(stack: WebStack, session: str) -> ToolSet:
    async with RegistryClient(stack.registry_target) as registry:
        return await registry.list_tools(session)


async def wait_for_tools(stack: WebStack, session: str, names: set[str]) -> ToolSet:
    """The session's tools once exactly `names` are listed (the bridge puts them in the background)."""

    async def listed() -> ToolSet | None:
        try:
            tools = await tools_of(stack, session)
        except Exception:  # the registry may be restarting
            return None
        return tools if {tool.name for tool in tools.tools} == names else None

    return await eventually(listed)


async def call(client: InvocationClient, session: str, tool: str, **arguments: object) -> CallResult:
    return await client.invoke(
        session, tool, turn_id="turn-1", arguments_json=json.dumps(arguments), timeout=10
    )


def failure_of(result: CallResult) -> tuple[ErrorKind, str, str, dict[str, object] | None]:
    assert result.outcome is not None and result.outcome.failure is not None
    failure = result.outcome.failure
    return failure.kind, failure.code, failure.message, failure.details


DECLARED = {
    "echo",
    "domain_fail",
    "boom",
    "not_json",
    "slow",
    "late",
    "steps",
    "noop",
    "held",
    "held_short",
    "pause",
}


async def test_a_page_declares_its_tools_and_serves_them(
    driver: BrowserDriver, stack: WebStack, client: InvocationClient
) -> None:
    await open_page(driver, stack, "a", "web-a")
    # No `tools put`: the page's declarations are the session's list.
    tools = await tools_of(stack, "web-a")
    assert {tool.name for tool in tools.tools} == DECLARED
    echo = tools.find("echo")
    assert echo is not None and echo.annotations.read_only and echo.annotations.idempotent
    assert json.loads(echo.input_schema_json)["properties"] == {"text": {"type": "string"}}
    slow = tools.find("slow")
    assert slow is not None and slow.timeout_ms == 700

    result = await call(client, "web-a", "echo", text="hello")
    assert result.outcome is not None and result.outcome.result_json is not None
    assert json.loads(result.outcome.result_json) == {
        "echo": {"text": "hello"},
        "sessionId": "web-a",
        "turnId": "turn-1",
        "toolRequestId": result.tool_request_id,
    }
    # And from the CLI, a process of its own.
    env = dict(os.environ, TOOLMESH_INVOCATION_ADDR=f"127.0.0.1:{stack.invocation.port}")
    code, out, _ = await run_cli(
        "tool-call", "--thread-id", "web-a", "--tool", "echo", "--args", '{"text": "cli"}', env=env
    )
    printed = json.loads(out)
    assert code == 0 and printed["ok"] is True and printed["result"]["echo"] == {"text": "cli"}


async def test_domain_errors_handler_errors_and_results_that_are_not_json(
    driver: BrowserDriver, stack: WebStack, client: InvocationClient
) -> None:
    kind, code, message, details = failure_of(await call(client, "web-a", "domain_fail"))
    assert (kind, code, message, details) == (
        ErrorKind.DOMAIN,
        "NO_ACTIVE_SELECTION",
        "Select text before using replace_selection.",
        {"documentId": "doc-7"},
    )
    boom = await call(client, "web-a", "boom")
    kind, code, _, details = failure_of(boom)
    assert (kind, code, details) == (
        ErrorKind.RUNTIME,
        Code.TOOL_HANDLER_ERROR.value,
        {"tool": "boom", "exception": "RangeError"},
    )
    assert "hunter2" not in json.dumps(boom.to_json())

    not_json = await call(client, "web-a", "not_json")
    kind, code, message, details = failure_of(not_json)
    assert (kind, code) == (ErrorKind.RUNTIME, Code.TOOL_RESULT_INVALID.value)
    assert details == {"reason": "not_json", "path": "$.value"} and "Map is not JSON" in message

    errors = await driver.eval("a", "window.toolmesh.errors")
    assert [(e["code"], e["toolName"], e["cause"]) for e in errors] == [
        ("TOOL_HANDLER_ERROR", "boom", ""),
        ("SUBMIT_TOOL_RESULT_FAILED", "not_json", "RESULT_NOT_JSON"),
    ]
    assert "hunter2" not in json.dumps(errors)


async def test_a_tool_without_handler_and_one_the_page_did_not_declare(
    stack: WebStack, client: InvocationClient
) -> None:
    # Put by someone else, alongside the page's declared tools.
    async with RegistryClient(stack.registry_target) as registry:
        listed = await registry.list_tools("web-a")
        await registry.put_tools("web-a", [*listed.tools, ToolSpec("undeclared"), ToolSpec("unhandled")])
    served = await call(client, "web-a", "undeclared")
    assert served.outcome is not None and served.outcome.result_json == '"served"'
    _, code, _, details = failure_of(await call(client, "web-a", "unhandled"))
    assert (code, details) == (Code.TOOL_HANDLER_NOT_FOUND.value, {"tool": "unhandled"})


async def test_a_page_reports_progress_to_its_caller(client: InvocationClient) -> None:
    reports: list[ToolProgress] = []
    result = await client.invoke("web-a", "steps", {"count": 3}, turn_id="t", on_progress=reports.append)
    assert result.outcome is not None and result.outcome.result_json == '{"done":3}'
    assert [(p.tool_request_id, p.progress, p.total, p.message) for p in reports] == [
        (result.tool_request_id, step, 3, f"step {step}") for step in (1, 2, 3)
    ]


async def test_timeout_aborts_the_handlers_signal_in_the_page(
    driver: BrowserDriver, client: InvocationClient
) -> None:
    result = await call(client, "web-a", "slow")
    _, code, _, _ = failure_of(result)
    assert code == Code.TOOL_TIMEOUT.value
    await driver.wait(
        "a", f"window.toolmesh.aborts.some(a => a.toolRequestId === {json.dumps(result.tool_request_id)})"
    )
    aborts = await driver.eval("a", "window.toolmesh.aborts")
    assert {"toolRequestId": result.tool_request_id, "reason": "TimeoutError"} in aborts
    # The page submitted nothing for it: no error reported.
    errors = await driver.eval("a", "window.toolmesh.errors")
    assert all(error["toolName"] != "slow" for error in errors)


async def test_the_page_answers_read_checks_so_it_gets_calls_before_hosts_that_do_not(
    driver: BrowserDriver, stack: WebStack, client: InvocationClient
) -> None:
    await open_page(driver, stack, "reads", "web-reads")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.bridge_port}") as channel:
        bridge = bridge_pb2_grpc.BridgeServiceStub(channel)
        stalled = []
        for n in range(10):  # hosts that read their first event, then nothing more
            events = bridge.OpenHostSession(
                bridge_pb2.OpenHostSessionRequest(
                    session_id="web-reads", host_name=f"stalled-{n}", handler_names=["echo"]
                )
            )
            await events.read()
            stalled.append(events)
        results = await asyncio.gather(
            *(client.invoke("web-reads", "echo", {"n": n}, turn_id="t", timeout=5) for n in range(10))
        )
        for events in stalled:
            events.cancel()
    assert [r.outcome.code if r.outcome is not None else r.code for r in results] == ["OK"] * 10


async def test_a_value_returned_after_the_call_ended_is_reported_not_dropped(
    driver: BrowserDriver, client: InvocationClient
) -> None:
    result = await call(client, "web-a", "late")
    _, code, _, _ = failure_of(result)
    assert code == Code.TOOL_TIMEOUT.value
    reported = (
        "window.toolmesh.errors.some(e => e.toolRequestId === "
        f"{json.dumps(result.tool_request_id)} && e.cause === 'REQUEST_ENDED')"
    )
    await driver.wait("a", reported)
    errors = await driver.eval("a", "window.toolmesh.errors")
    assert [e["code"] for e in errors if e["toolRequestId"] == result.tool_request_id] == [
        Code.SUBMIT_TOOL_RESULT_FAILED.value
    ]


async def test_grpc_web_and_a_second_tab_that_never_sees_the_first_ones_requests(
    driver: BrowserDriver, stack: WebStack, client: InvocationClient
) -> None:
    await open_page(driver, stack, "b", "web-b", protocol="grpc-web")
    results = await asyncio.gather(
        *(call(client, "web-a", "echo", n=i) for i in range(10)),
        *(call(client, "web-b", "echo", n=i) for i in range(10)),
    )
    for result, session in zip(results, ["web-a"] * 10 + ["web-b"] * 10, strict=True):
        assert result.outcome is not None and result.outcome.result_json is not None
        assert json.loads(result.outcome.result_json)["sessionId"] == session
    seen_a = await driver.eval("a", "window.toolmesh.seen")
    seen_b = await driver.eval("b", "window.toolmesh.seen")
    assert {s["sessionId"] for s in seen_a} == {"web-a"} and {s["sessionId"] for s in seen_b} == {"web-b"}
    ids_b = {s["toolRequestId"] for s in seen_b}
    assert len(ids_b) == 10 and not ids_b & {s["toolRequestId"] for s in seen_a}
    await driver.command("close", tab="b")


async def test_a_page_from_an_origin_not_allowed_is_refused(driver: BrowserDriver, stack: WebStack) -> None:
    query = {"session": "web-evil", "baseUrl": stack.web_url, "startTimeoutMs": "1500"}
    opened = await driver.open("evil", query, origin=1)
    assert opened["started"] is False and "no host session" in opened["startError"]
    assert (await tools_of(stack, "web-evil")).revision == 0
    await driver.command("close", tab="evil")


async def test_the_page_reconnects_after_the_bridge_restarts_and_redeclares_after_the_registry_does(
    driver: BrowserDriver, stack: WebStack, client: InvocationClient
) -> None:
    first = await driver.eval("a", "window.toolmesh.hostSessionId()")
    await stack.restart_bridge()
    await driver.wait(
        "a", f"window.toolmesh.connected() && window.toolmesh.hostSessionId() !== {json.dumps(first)}"
    )
    result = await call(client, "web-a", "echo", after="bridge restart")
    assert result.outcome is not None and result.outcome.result_json is not None

    await stack.restart_registry()
    tools = await wait_for_tools(stack, "web-a", DECLARED)
    assert tools.revision >= 1
    result = await call(client, "web-a", "echo", after="registry restart")
    assert result.outcome is not None and result.outcome.result_json is not None


async def test_webmcp_tools_are_served_through_toolmesh(
    driver: BrowserDriver, stack: WebStack, client: InvocationClient
) -> None:
    await open_page(driver, stack, "w", "web-mcp", webmcp=True, mode="webmcp")
    # The browser's own WebMCP holds them too: the SDK wraps registerTool, it does not replace it.
    assert sorted(await driver.eval("w", "window.toolmesh.nativeTools()")) == [
        "add_todo",
        "fail_todo",
        "list_todos",
    ]
    tools = await wait_for_tools(stack, "web-mcp", {"add_todo", "list_todos", "fail_todo"})
    listing = tools.find("list_todos")
    add = tools.find("add_todo")
    assert (
        listing is not None
        and listing.annotations.read_only
        and listing.description == "List the to-do items."
    )
    assert add is not None and not add.annotations.read_only
    assert json.loads(add.input_schema_json)["required"] == ["text"]

    added = await call(client, "web-mcp", "add_todo", text="milk")
    assert added.outcome is not None and added.outcome.result_json is not None
    assert json.loads(added.outcome.result_json) == {"content": [{"type": "text", "text": "Added milk"}]}
    assert await driver.eval("w", "window.toolmesh.todos") == ["milk"]
    _, code, message, _ = failure_of(await call(client, "web-mcp", "fail_todo"))
    assert (code, message) == ("WEBMCP_TOOL_ERROR", "No such list.")
    _, code, _, _ = failure_of(await call(client, "web-mcp", "add_todo", text=3))
    assert code == Code.TOOL_ARGS_INVALID.value

    # Unregistration by AbortSignal withdraws it from the session's list.
    await driver.eval("w", "window.toolmesh.unregister('list_todos')")
    await wait_for_tools(stack, "web-mcp", {"add_todo", "fail_todo"})
    assert sorted(await driver.eval("w", "window.toolmesh.nativeTools()")) == ["add_todo", "fail_todo"]
    _, code, _, _ = failure_of(await call(client, "web-mcp", "list_todos"))
    assert code == Code.TOOL_NOT_FOUND.value


async def submit_requests(driver: BrowserDriver, tab: str) -> Counter[str]:
    """The page's result submissions so far, by RPC (its resource timings)."""
    names: list[str] = await driver.eval(
        tab,
        "performance.getEntriesByType('resource').map((e) => e.name.split('/').pop())"
        ".filter((name) => name.startsWith('SubmitToolResult'))",
    )
    return Counter(names)


async def start_asks(driver: BrowserDriver, tab: str) -> int:
    """How many StartToolRequests calls the page has made and read the answer of."""
    count: int = await driver.eval(
        tab,
        "performance.getEntriesByType('resource')"
        ".filter((e) => e.name.split('/').pop() === 'StartToolRequests').length",
    )
    return count


async def test_a_page_runs_read_only_requests_without_asking_to_start_and_asks_for_the_others(
    driver: BrowserDriver, stack: WebStack, client: InvocationClient
) -> None:
    # A read-only or idempotent request goes to another host if the page leaves, started or not.
    await open_page(driver, stack, "asks", "web-asks")
    await driver.eval("asks", "performance.setResourceTimingBufferSize(10000)")
    await wait_for_tools(stack, "web-asks", DECLARED)
    for n in range(3):
        result = await call(client, "web-asks", "echo", text=str(n))
        assert result.outcome is not None and result.outcome.failure is None, result
    result = await call(client, "web-asks", "noop")
    assert result.outcome is not None and result.outcome.failure is None, result
    # The one START the page asked for is recorded once it has read the answer (the handler ran).
    await eventually(lambda: start_asks(driver, "asks"))
    assert await start_asks(driver, "asks") == 1
    assert await driver.eval("asks", "window.toolmesh.errors") == []
    await driver.command("close", tab="asks")


@pytest.mark.parametrize("batches_served", [True, False], ids=["batched", "older-bridge"])
async def test_results_that_end_together_share_requests_and_each_call_gets_its_own_once(
    driver: BrowserDriver, stack: WebStack, client: InvocationClient, batches_served: bool
) -> None:
    calls = 24
    await open_page(driver, stack, "submits", "web-submits")
    if not batches_served:
        # A bridge without SubmitToolResults answers it 404 (UNIMPLEMENTED): one result per call then.
        await driver.command("unserved", tab="submits", method="SubmitToolResults")
    await driver.eval("submits", "performance.setResourceTimingBufferSize(10000)")
    await wait_for_tools(stack, "web-submits", DECLARED)
    running = [
        asyncio.create_task(client.invoke("web-submits", "held", {"order": order}, turn_id="t"))
        for order in range(calls)
    ]

    async def all_held() -> bool:
        seen = "window.toolmesh.seen.filter((s) => s.tool === 'held').length"
        held: int = await driver.eval("submits", seen)
        return held == calls

    await eventually(all_held, timeout=15)
    assert await submit_requests(driver, "submits") == Counter()
    # Every handler answers in the same task: their results go in a few requests, not one each.
    assert await driver.eval("submits", "window.toolmesh.release()") == calls
    results = await asyncio.wait_for(asyncio.gather(*running), 15)
    for order, result in enumerate(results):
        assert result.outcome is not None and result.outcome.failure is None, result
        assert json.loads(result.outcome.result_json or "") == {
            "held": {"order": order},
            "toolRequestId": result.tool_request_id,
        }
    assert len({result.tool_request_id for result in results}) == calls
    # A request's resource timing is recorded once the page has read its response, which may be
    # after the bridge took the results and the callers heard: wait for the entries, not the calls.
    if batches_served:

        async def batched() -> Counter[str] | None:
            requests = await submit_requests(driver, "submits")
            return requests if requests["SubmitToolResults"] >= 1 else None

        requests = await eventually(batched)
        assert sum(requests.values()) < calls, requests
    else:
        # Asked once, then every result alone (those of the refused batch sent again, one by one).
        alone = Counter({"SubmitToolResults": 1, "SubmitToolResult": calls})

        async def one_by_one() -> bool:
            return await submit_requests(driver, "submits") == alone

        await eventually(one_by_one, message=f"the page's submissions never came to {alone}")
    # The bridge took every result the first time: the page reported no failed submission.
    assert await driver.eval("submits", "window.toolmesh.errors") == []
    await driver.command("close", tab="submits")


async def test_a_page_runs_requests_that_come_together_each_once(
    driver: BrowserDriver, stack: WebStack
) -> None:
    """Five requests in one dispatch message reach the page in one event (it reads batches): each
    asks START and runs once, and each result goes to its own call."""
    await open_page(driver, stack, "batch", "web-batch")
    await wait_for_tools(stack, "web-batch", DECLARED)
    ids = [f"web-batch-{n}" for n in range(5)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.bridge.internal_port}") as channel:
        requests = [
            bridge_pb2.ToolRequest(
                session_id="web-batch",
                turn_id="turn-1",
                tool_request_id=request_id,
                tool_name=tool,
                arguments_json=json.dumps({"n": n}),
                timeout_ms=10_000,
            )
            for n, request_id in enumerate(ids)
            for tool in ["noop" if n % 2 else "echo"]
        ]
        answered = await dispatch_together(bridge_pb2_grpc.BridgeServiceStub(channel), requests)
    for n, request_id in enumerate(ids):
        assert json.loads(answered[request_id]) == (
            {"ok": True}
            if n % 2
            else {"echo": {"n": n}, "sessionId": "web-batch", "turnId": "turn-1", "toolRequestId": request_id}
        )
    seen = await driver.eval("batch", "window.toolmesh.seen.map(s => s.toolRequestId)")
    assert sorted(s for s in seen if s.startswith("web-batch-")) == [i for i in ids if int(i[-1]) % 2 == 0]
    assert await driver.eval("batch", "window.toolmesh.errors") == []
