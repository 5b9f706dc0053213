"""A page serving tools through two bridge replicas on one Redis, in a real Chromium: when the
replica it is on dies mid-handler, or freezes (SIGSTOP: its connections stay open and nothing
answers), it hands the results to the other one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from browser_driver import BrowserDriver, build_test_page
from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_invocation, start_registry
from toolmesh.client import Invocation, InvocationClient, RegistryClient
from toolmesh.runtime.server import RunningServer
from toolmesh.store.backends import open_stores
from toolmesh_testing import ServiceProcess, eventually, start_service_process

pytestmark = pytest.mark.integration

SESSION = "web-replicas"


@dataclass
class Replicas:
    driver: BrowserDriver
    registry: RunningServer
    # The page's stream is on bridge 0 (its first URL); both are processes, to kill or freeze.
    bridges: list[ServiceProcess]
    invocation: RunningServer
    # How to start another bridge replica like them.
    bridge_args: tuple[str, ...]
    env: dict[str, str]


@pytest_asyncio.fixture
async def replicas() -> AsyncIterator[Replicas]:
    """Two bridge replicas on one Redis, an invocation replica whose default is bridge 1 (only the
    route takes a call to the page's replica), and the page in tab "p", its tools declared."""
    prefix = new_prefix()
    await asyncio.to_thread(build_test_page)
    driver = await BrowserDriver.start()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    bridges: list[ServiceProcess] = []
    bridge_args = ("--registry", registry_internal, "--web-origins", driver.origins[0])
    invocation = None
    try:
        for _ in range(2):
            bridges.append(await start_service_process("bridge", *bridge_args, env=env))
        invocation = await start_invocation(
            registry_internal, bridges[1].internal_target, stores=open_stores(SHARED_URL, prefix)
        )
        base_urls = ",".join(f"http://127.0.0.1:{bridge.web_port}" for bridge in bridges)
        opened = await driver.open("p", {"session": SESSION, "baseUrl": base_urls})
        assert opened == {"started": True, "startError": ""}

        async def declared() -> bool:
            async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
                tools = await client.list_tools(SESSION)
                return tools.find("held") is not None and tools.find("held_short") is not None

        await eventually(declared)
        yield Replicas(driver, registry, bridges, invocation, bridge_args, env)
    finally:
        await driver.stop()
        if invocation is not None:
            await invocation.stop(0.5)
        for bridge in bridges:
            if bridge.process.returncode is None:
                bridge.process.send_signal(signal.SIGCONT)
                bridge.process.kill()
            await bridge.stop()
        await registry.stop(0.5)
        await delete_prefixed(SHARED_URL, prefix)


async def test_a_page_hands_its_result_to_the_other_bridge_replica_when_its_own_is_killed(
    replicas: Replicas,
) -> None:
    driver = replicas.driver
    async with InvocationClient(f"127.0.0.1:{replicas.invocation.port}") as client:
        calling = asyncio.create_task(client.invoke(SESSION, "held", {"n": 1}, turn_id="t"))
        await driver.wait("p", "window.toolmesh.seen.some(s => s.tool === 'held')")
        first = await driver.eval("p", "window.toolmesh.hostSessionId()")
        # The replica the page is on (its first URL) dies while the handler runs.
        replicas.bridges[0].process.kill()
        await driver.wait(
            "p", f"window.toolmesh.connected() && window.toolmesh.hostSessionId() !== {json.dumps(first)}"
        )
        assert await driver.eval("p", "window.toolmesh.release()") == 1
        result = await asyncio.wait_for(calling, 20)
    seen = await driver.eval("p", "window.toolmesh.seen.filter(s => s.tool === 'held')")
    errors = await driver.eval("p", "window.toolmesh.errors")
    assert result.outcome is not None and result.outcome.result_json is not None, result
    assert json.loads(result.outcome.result_json) == {
        "held": {"n": 1},
        "toolRequestId": result.tool_request_id,
    }
    # Run once, answered once: the caller got the handler's own result, and nothing went astray.
    assert [s["toolRequestId"] for s in seen] == [result.tool_request_id]
    assert errors == []


CALLS = 3


async def test_a_page_hands_its_results_to_the_other_bridge_replica_when_its_own_is_frozen(
    replicas: Replicas,
) -> None:
    """held_short's 5 s timeout is shorter than the bridge's silence takes to notice (3 missed
    heartbeats of 5 s): only the page's own submits, left unanswered, tell it to move."""
    driver = replicas.driver
    async with InvocationClient(f"127.0.0.1:{replicas.invocation.port}") as client:
        calling = [
            asyncio.create_task(client.invoke(SESSION, "held_short", {"n": n}, turn_id="t"))
            for n in range(CALLS)
        ]
        await driver.wait(
            "p", f"window.toolmesh.seen.filter(s => s.tool === 'held_short').length === {CALLS}"
        )
        first = await driver.eval("p", "window.toolmesh.hostSessionId()")
        # The replica the page is on freezes while the handlers run; they answer then.
        replicas.bridges[0].process.send_signal(signal.SIGSTOP)
        assert await driver.eval("p", "window.toolmesh.release()") == CALLS
        results = await asyncio.wait_for(asyncio.gather(*calling), 20)
        # Copies of the results were taken by the other replica; the page leaves the frozen one
        # once their answers do not come (each attempt's share of the time).
        await driver.wait(
            "p", f"window.toolmesh.connected() && window.toolmesh.hostSessionId() !== {json.dumps(first)}"
        )
    seen = await driver.eval("p", "window.toolmesh.seen.filter(s => s.tool === 'held_short')")
    errors = await driver.eval("p", "window.toolmesh.errors")
    now = await driver.eval("p", "window.toolmesh.hostSessionId()")
    for n, result in enumerate(results):
        assert result.outcome is not None and result.outcome.result_json is not None, result
        assert json.loads(result.outcome.result_json) == {
            "held": {"n": n},
            "toolRequestId": result.tool_request_id,
        }
    # Each call ran once and got its own result once; the page moved to the other replica.
    ids = [r.tool_request_id or "" for r in results]
    assert sorted(s["toolRequestId"] for s in seen) == sorted(ids)
    assert len(set(ids) - {""}) == CALLS
    assert now not in ("", first)
    assert errors == []


async def test_a_page_hands_a_copy_of_its_result_to_the_other_replica_when_its_own_is_frozen(
    replicas: Replicas,
) -> None:
    """held's 30 s timeout gives a submit attempt 5 s before the page leaves a silent replica; a
    copy of the result goes to the other replica after 0.5 s, which records it, so the caller has
    it long before (a page closed meanwhile would lose nothing)."""
    driver = replicas.driver
    async with InvocationClient(f"127.0.0.1:{replicas.invocation.port}") as client:
        calling = asyncio.create_task(client.invoke(SESSION, "held", {"n": 2}, turn_id="t"))
        await driver.wait("p", "window.toolmesh.seen.some(s => s.tool === 'held')")
        replicas.bridges[0].process.send_signal(signal.SIGSTOP)
        assert await driver.eval("p", "window.toolmesh.release()") == 1
        result = await asyncio.wait_for(calling, 4)
    assert result.outcome is not None and result.outcome.result_json is not None, result
    assert json.loads(result.outcome.result_json) == {
        "held": {"n": 2},
        "toolRequestId": result.tool_request_id,
    }
    seen = await driver.eval("p", "window.toolmesh.seen.filter(s => s.tool === 'held')")
    assert [s["toolRequestId"] for s in seen] == [result.tool_request_id]
    assert await driver.eval("p", "window.toolmesh.errors") == []


async def test_a_page_whose_every_bridge_replica_froze_stays_and_hands_its_result_in_after(
    replicas: Replicas,
) -> None:
    """Both replicas frozen while the handler ends: the copy goes nowhere, and when the submit's
    share of the time runs out no other replica answers its health check, so the page stays on its
    own. Once that one thaws it takes the result. Had the page left, the thawed replica would have
    ended the request TOOL_HOST_DISCONNECTED and refused the result after."""
    driver = replicas.driver
    async with InvocationClient(f"127.0.0.1:{replicas.invocation.port}") as client:
        calling = asyncio.create_task(client.invoke(SESSION, "held", {"n": 3}, turn_id="t"))
        await driver.wait("p", "window.toolmesh.seen.some(s => s.tool === 'held')")
        first = await driver.eval("p", "window.toolmesh.hostSessionId()")
        for bridge in replicas.bridges:
            bridge.process.send_signal(signal.SIGSTOP)
        try:
            assert await driver.eval("p", "window.toolmesh.release()") == 1
            staying = "window.toolmesh.warnings.some(w => w.includes('no other replica answers; staying'))"
            await driver.wait("p", staying, timeout_ms=15_000)
        finally:
            for bridge in replicas.bridges:
                bridge.process.send_signal(signal.SIGCONT)
        result = await asyncio.wait_for(calling, 10)
    assert result.outcome is not None and result.outcome.result_json is not None, result
    assert json.loads(result.outcome.result_json) == {
        "held": {"n": 3},
        "toolRequestId": result.tool_request_id,
    }
    assert await driver.eval("p", "window.toolmesh.hostSessionId()") == first
    assert await driver.eval("p", "window.toolmesh.errors") == []


async def test_a_page_hands_its_result_in_late_when_every_bridge_replica_froze_past_the_deadline(
    replicas: Replicas,
) -> None:
    """Both replicas frozen while the handler ends: the caller is told TOOL_TIMEOUT (may have run);
    the page keeps handing the result in past the deadline, and once a replica thaws the ledger
    keeps it beside the timeout, where GetInvocation shows what the handler did."""
    driver = replicas.driver
    async with InvocationClient(f"127.0.0.1:{replicas.invocation.port}") as client:
        calling = asyncio.create_task(client.invoke(SESSION, "held_short", {"n": 7}, turn_id="t"))
        await driver.wait("p", "window.toolmesh.seen.some(s => s.tool === 'held_short')")
        for bridge in replicas.bridges:
            bridge.process.send_signal(signal.SIGSTOP)
        assert await driver.eval("p", "window.toolmesh.release()") == 1
        result = await asyncio.wait_for(calling, 20)
        assert result.outcome is not None and result.outcome.code == "TOOL_TIMEOUT", result
        assert result.tool_request_id is not None
        for bridge in replicas.bridges:
            bridge.process.send_signal(signal.SIGCONT)

        async def late() -> Invocation | None:
            shown = await client.get_invocation(str(result.tool_request_id))
            return shown if shown.late_outcome is not None else None

        shown = await eventually(late, timeout=40)
    assert shown.outcome == result.outcome
    assert shown.late_outcome is not None and shown.late_outcome.result_json is not None
    assert json.loads(shown.late_outcome.result_json) == {
        "held": {"n": 7},
        "toolRequestId": result.tool_request_id,
    }
    seen = await driver.eval("p", "window.toolmesh.seen.filter(s => s.tool === 'held_short')")
    assert [s["toolRequestId"] for s in seen] == [result.tool_request_id]
    assert await driver.eval("p", "window.toolmesh.errors") == []


async def test_a_page_opening_while_its_first_replica_is_frozen_opens_on_the_other(
    replicas: Replicas,
) -> None:
    """The frozen replica takes connections and says nothing. The page asks both replicas' health
    check (`GET /healthz`) before it opens, and opens on the one that answers: within 3 s, where
    opening on the frozen one first would wait out the first-event wait (5 s) before moving on."""
    driver = replicas.driver
    replicas.bridges[0].process.send_signal(signal.SIGSTOP)
    base_urls = ",".join(f"http://127.0.0.1:{bridge.web_port}" for bridge in replicas.bridges)
    opened = await driver.open(
        "q", {"session": f"{SESSION}-q", "baseUrl": base_urls, "startTimeoutMs": "3000"}
    )
    assert opened == {"started": True, "startError": ""}
    async with InvocationClient(f"127.0.0.1:{replicas.invocation.port}") as client:
        result = await asyncio.wait_for(client.invoke(f"{SESSION}-q", "echo", {"text": "x"}, turn_id="t"), 20)
    assert result.outcome is not None and result.outcome.failure is None, result


async def test_a_page_opening_while_one_replica_is_frozen_and_the_other_restarts_opens_on_the_restarted_one(
    replicas: Replicas,
) -> None:
    """The page's second replica is coming back (its port drops connections: a process restarting)
    while the first is frozen. The page asks the second's health check again until it answers and
    opens there: within 4.5 s, where one failed check counted it out and the page waited 5 s for the
    frozen one's answer, then 5 s more for its first event."""
    driver = replicas.driver
    replicas.bridges[0].process.send_signal(signal.SIGSTOP)
    asked = asyncio.Event()

    def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.set()
        writer.transport.abort()

    restarting = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = restarting.sockets[0].getsockname()[1]
    base_urls = f"http://127.0.0.1:{replicas.bridges[0].web_port},http://127.0.0.1:{port}"
    opening = asyncio.create_task(
        driver.open("r", {"session": f"{SESSION}-r", "baseUrl": base_urls, "startTimeoutMs": "4500"})
    )
    back = None
    try:
        await asyncio.wait_for(asked.wait(), 10)  # the page's first check of the second was dropped
        restarting.close()
        await restarting.wait_closed()
        back = await start_service_process(
            "bridge", *replicas.bridge_args, env=replicas.env, ports={"bridge-web": port}
        )
        assert await opening == {"started": True, "startError": ""}
        async with InvocationClient(f"127.0.0.1:{replicas.invocation.port}") as client:
            result = await asyncio.wait_for(
                client.invoke(f"{SESSION}-r", "echo", {"text": "x"}, turn_id="t"), 20
            )
        assert result.outcome is not None and result.outcome.failure is None, result
    finally:
        opening.cancel()
        if back is not None:
            await back.stop()


async def test_a_page_busy_while_its_result_is_answered_stays_on_its_replica(
    replicas: Replicas,
) -> None:
    """The page's replica answers a result while the page is busy (a 2.5 s long task: no timer
    runs and no answer is read meanwhile), past the submit's share of the time: the page then reads
    the answer and does not take its replica for silent (as the Python host once did, thawed from
    a pause); the request it still runs there keeps running, and ends with its result."""
    driver = replicas.driver
    async with InvocationClient(f"127.0.0.1:{replicas.invocation.port}") as client:
        short = asyncio.create_task(client.invoke(SESSION, "held_short", {"n": 8}, turn_id="t"))
        await driver.wait("p", "window.toolmesh.seen.length === 1")
        running = asyncio.create_task(client.invoke(SESSION, "held", {"n": 9}, turn_id="t"))
        await driver.wait("p", "window.toolmesh.seen.length === 2")
        first = await driver.eval("p", "window.toolmesh.hostSessionId()")
        frozen = replicas.bridges[0].process
        frozen.send_signal(signal.SIGSTOP)
        try:
            assert await driver.eval("p", "window.toolmesh.release(1)") == 1
            # The scenario's timing (nothing outside the page can see a submit in flight, nor a
            # long task begin): the result goes out, then the page is busy, then the replica thaws
            # and answers.
            await asyncio.sleep(0.2)
            busy = asyncio.create_task(
                driver.eval("p", "(() => { const end = Date.now() + 2500; while (Date.now() < end) {} })()")
            )
            await asyncio.sleep(0.2)
        finally:
            frozen.send_signal(signal.SIGCONT)
        await busy
        answered = await asyncio.wait_for(short, 10)
        assert answered.outcome is not None and answered.outcome.result_json is not None, answered
        assert await driver.eval("p", "window.toolmesh.release()") == 1
        result = await asyncio.wait_for(running, 10)
    assert result.outcome is not None and result.outcome.result_json is not None, result
    assert await driver.eval("p", "window.toolmesh.hostSessionId()") == first
    assert await driver.eval("p", "window.toolmesh.errors") == []
