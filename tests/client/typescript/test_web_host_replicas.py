"""A page serving tools through two bridge replicas on one Redis, in a real Chromium: when the
replica it is on dies mid-handler, it hands the result to the other one."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from browser_driver import BrowserDriver, build_test_page
from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import start_invocation, start_registry
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.store.backends import open_stores
from toolmesh_testing import ServiceProcess, eventually, start_service_process

pytestmark = pytest.mark.integration

SESSION = "web-replicas"


async def test_a_page_hands_its_result_to_the_other_bridge_replica_when_its_own_is_killed() -> None:
    prefix = new_prefix()
    await asyncio.to_thread(build_test_page)
    driver = await BrowserDriver.start()
    registry = await start_registry(stores=open_stores(SHARED_URL, prefix))
    registry_internal = f"127.0.0.1:{registry.internal_port}"
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    bridges: list[ServiceProcess] = []
    invocation = None
    try:
        for _ in range(2):
            bridge = await start_service_process(
                "bridge",
                "--registry",
                registry_internal,
                "--web-origins",
                driver.origins[0],
                env=env,
            )
            bridges.append(bridge)
        # Its default is the second replica: only the route takes the call to the page's.
        invocation = await start_invocation(
            registry_internal, bridges[1].internal_target, stores=open_stores(SHARED_URL, prefix)
        )
        base_urls = ",".join(f"http://127.0.0.1:{bridge.web_port}" for bridge in bridges)
        opened = await driver.open("p", {"session": SESSION, "baseUrl": base_urls})
        assert opened == {"started": True, "startError": ""}

        async def declared() -> bool:
            async with RegistryClient(f"127.0.0.1:{registry.port}") as client:
                return (await client.list_tools(SESSION)).find("held") is not None

        await eventually(declared)
        async with InvocationClient(f"127.0.0.1:{invocation.port}") as client:
            calling = asyncio.create_task(client.invoke(SESSION, "held", {"n": 1}, turn_id="t"))
            await driver.wait("p", "window.toolmesh.seen.some(s => s.tool === 'held')")
            first = await driver.eval("p", "window.toolmesh.hostSessionId()")
            # The replica the page is on (its first URL) dies while the handler runs.
            bridges[0].process.kill()
            await driver.wait(
                "p", f"window.toolmesh.connected() && window.toolmesh.hostSessionId() !== {json.dumps(first)}"
            )
            assert await driver.eval("p", "window.toolmesh.release()") == 1
            result = await asyncio.wait_for(calling, 20)
        seen = await driver.eval("p", "window.toolmesh.seen.filter(s => s.tool === 'held')")
        errors = await driver.eval("p", "window.toolmesh.errors")
    finally:
        await driver.stop()
        if invocation is not None:
            await invocation.stop(0.5)
        for bridge in bridges:
            if bridge.process.returncode is None:
                bridge.process.kill()
            await bridge.stop()
        await registry.stop(0.5)
        await delete_prefixed(SHARED_URL, prefix)
    assert result.outcome is not None and result.outcome.result_json is not None, result
    assert json.loads(result.outcome.result_json) == {
        "held": {"n": 1},
        "toolRequestId": result.tool_request_id,
    }
    # Run once, answered once: the caller got the handler's own result, and nothing went astray.
    assert [s["toolRequestId"] for s in seen] == [result.tool_request_id]
    assert errors == []
