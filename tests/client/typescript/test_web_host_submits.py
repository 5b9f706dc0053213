"""The page SDK hands in results that end together in fewer requests than results
(SubmitToolResults), and every call gets its own result, once.

Real Chromium (playwright-core), the real services; the requests the page made are read from its
resource timings.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from browser_driver import BrowserDriver, build_test_page
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh_testing import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "page-submits"
CALLS = 24


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


async def submit_requests(driver: BrowserDriver, tab: str) -> Counter[str]:
    """The page's result submissions so far, by RPC."""
    names: list[str] = await driver.eval(
        tab,
        "performance.getEntriesByType('resource').map((e) => e.name.split('/').pop())"
        ".filter((name) => name.startsWith('SubmitToolResult'))",
    )
    return Counter(names)


async def held_calls(driver: BrowserDriver, tab: str) -> int:
    count: int = await driver.eval(tab, "window.toolmesh.seen.filter((s) => s.tool === 'held').length")
    return count


async def test_results_that_end_together_share_requests_and_each_call_gets_its_own_once(
    driver: BrowserDriver, system: LocalSystem
) -> None:
    opened = await driver.open("submits", {"session": SESSION, "baseUrl": system.web_url})
    assert opened == {"started": True, "startError": ""}
    await driver.eval("submits", "performance.setResourceTimingBufferSize(10000)")
    async with RegistryClient(system.registry_target) as registry:
        await eventually(lambda: _lists(registry, "held"))
    async with InvocationClient(system.invocation_target) as client:
        calls = [
            asyncio.create_task(client.invoke(SESSION, "held", {"order": order}, turn_id="t"))
            for order in range(CALLS)
        ]
        await eventually(lambda: _all_held(driver), timeout=15)
        assert await submit_requests(driver, "submits") == Counter()
        # Every handler answers in the same task: their results go in a few calls, not one each.
        assert await driver.eval("submits", "window.toolmesh.release()") == CALLS
        results = await asyncio.wait_for(asyncio.gather(*calls), 15)
    for order, result in enumerate(results):
        assert result.outcome is not None and result.outcome.failure is None, result
        assert json.loads(result.outcome.result_json or "") == {
            "held": {"order": order},
            "toolRequestId": result.tool_request_id,
        }
    assert len({result.tool_request_id for result in results}) == CALLS
    requests = await submit_requests(driver, "submits")
    assert requests["SubmitToolResults"] >= 1
    assert sum(requests.values()) < CALLS, requests
    # The bridge took every result the first time: the page reported no failed submission.
    assert await driver.eval("submits", "window.toolmesh.errors") == []
    await driver.command("close", tab="submits")


async def _all_held(driver: BrowserDriver) -> bool:
    return await held_calls(driver, "submits") == CALLS


async def _lists(registry: RegistryClient, name: str) -> bool:
    return name in {tool.name for tool in (await registry.list_tools(SESSION)).tools}
