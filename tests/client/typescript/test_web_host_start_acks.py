"""The page SDK acknowledges starts: a page that reloads with a request it never started runs it
after the reload, once, and the caller gets its result (not TOOL_HOST_DISCONNECTED).

Real Chromium (playwright-core), the real services, the page's own StartToolRequests held in
the browser so that the request is delivered and never started when the page reloads.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from browser_driver import BrowserDriver, build_test_page
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh_testing import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "page-reload"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def driver() -> AsyncIterator[BrowserDriver]:
    await asyncio.to_thread(build_test_page)
    running = await BrowserDriver.start()
    yield running
    await running.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system(driver: BrowserDriver) -> AsyncIterator[LocalSystem]:
    running = await start_local_system(web_origins=[driver.origins[0]], heartbeat_s=0.5)
    yield running
    await running.stop(0.5)


async def seen(driver: BrowserDriver, tab: str) -> list[str]:
    """The tool request ids the page's "held" handler started with, since the page loaded."""
    ids: list[str] = await driver.eval(
        tab, "window.toolmesh.seen.filter((s) => s.tool === 'held').map((s) => s.toolRequestId)"
    )
    return ids


async def test_a_page_that_reloads_runs_the_request_it_never_started(
    driver: BrowserDriver, system: LocalSystem
) -> None:
    opened = await driver.open("reload", {"session": SESSION, "baseUrl": system.web_url})
    assert opened == {"started": True, "startError": ""}
    async with RegistryClient(system.registry_target) as registry:
        await eventually(lambda: _lists(registry, "held"))
    # The page's ask to start never reaches the bridge: the request is delivered, never started.
    await driver.hold("reload", "StartToolRequests")
    async with InvocationClient(system.invocation_target) as client:
        calling = asyncio.create_task(client.invoke(SESSION, "held", {"order": 7}, turn_id="t"))
        await eventually(lambda: driver.held("reload"))
        assert await seen(driver, "reload") == []
        reloaded = await driver.reload("reload")
        assert reloaded == {"started": True, "startError": ""}
        # The bridge kept it for the page's next host session, which runs it.
        [tool_request_id] = await eventually(lambda: seen(driver, "reload"), timeout=15)
        assert await driver.eval("reload", "window.toolmesh.release()") == 1
        result = await asyncio.wait_for(calling, 15)
    assert result.outcome is not None and result.outcome.failure is None, result
    assert result.tool_request_id == tool_request_id
    assert json.loads(result.outcome.result_json or "") == {
        "held": {"order": 7},
        "toolRequestId": tool_request_id,
    }
    assert await seen(driver, "reload") == [tool_request_id]
    await driver.command("close", tab="reload")


async def test_a_page_that_reloads_mid_call_still_ends_tool_host_disconnected(
    driver: BrowserDriver, system: LocalSystem
) -> None:
    opened = await driver.open("started", {"session": f"{SESSION}-2", "baseUrl": system.web_url})
    assert opened == {"started": True, "startError": ""}
    async with RegistryClient(system.registry_target) as registry:
        await eventually(lambda: _lists(registry, "held", f"{SESSION}-2"))
    async with InvocationClient(system.invocation_target) as client:
        calling = asyncio.create_task(client.invoke(f"{SESSION}-2", "held", {"order": 8}, turn_id="t"))
        await eventually(lambda: seen(driver, "started"))  # started: it may have had effects
        await driver.reload("started")
        result = await asyncio.wait_for(calling, 15)
    assert result.outcome is not None and result.outcome.code == "TOOL_HOST_DISCONNECTED", result
    assert await seen(driver, "started") == []  # not run again after the reload
    await driver.command("close", tab="started")


async def _lists(registry: RegistryClient, name: str, session: str = SESSION) -> bool:
    return name in {tool.name for tool in (await registry.list_tools(session)).tools}
