"""Pages as handler hosts with tokens: the TypeScript SDK's `token` option, in a real Chromium.

The bridge requires signed tokens on its web port as on its gRPC port. A page
whose token names its session serves it; one whose token names another
session, or that has none, is refused with a typed error: `start()` rejects
naming the code, and `onError` hears of it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from trust_testing import SECRET, token

from bench.browser import BrowserDriver, build_test_page
from toolmesh.auth.tokens import SharedSecret, Verifier
from toolmesh.client import InvocationClient
from toolmesh.server.runtime import RunningServer
from toolmesh.server.security import Security
from toolmesh.server.system import start_bridge, start_invocation, start_registry

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "web-tokens"


@dataclass
class SecuredStack:
    registry: RunningServer
    bridge: RunningServer
    invocation: RunningServer

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.bridge.web_port}"

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
async def stack(driver: BrowserDriver) -> AsyncIterator[SecuredStack]:
    security = Security(verifier=Verifier(SharedSecret(SECRET)))
    registry = await start_registry(security=security)
    bridge, _ = await start_bridge(
        heartbeat_s=0.3,
        registry_target=f"127.0.0.1:{registry.internal_port}",
        web_address="127.0.0.1:0",
        web_origins=[driver.origins[0]],
        security=security,
    )
    invocation = await start_invocation(
        f"127.0.0.1:{registry.internal_port}", f"127.0.0.1:{bridge.internal_port}", security=security
    )
    running = SecuredStack(registry, bridge, invocation)
    yield running
    await running.stop()


async def test_a_page_with_its_sessions_host_token_serves_it(
    driver: BrowserDriver, stack: SecuredStack
) -> None:
    query = {"session": SESSION, "baseUrl": stack.web_url, "token": token("host", SESSION)}
    assert await driver.open("ok", query) == {"started": True, "startError": ""}
    async with InvocationClient(f"127.0.0.1:{stack.invocation.port}", token=token("call", SESSION)) as client:
        result = await client.invoke(SESSION, "echo", {"text": "hi"}, turn_id="t", timeout=10)
    assert result.outcome is not None and result.outcome.result_json is not None
    assert json.loads(result.outcome.result_json)["sessionId"] == SESSION
    assert await driver.eval("ok", "window.toolmesh.errors") == []
    await driver.command("close", tab="ok")


@pytest.mark.parametrize(
    ("tab", "host_token", "refusal"),
    [
        ("other", token("host", "another-session"), ("PERMISSION_DENIED", "")),
        ("caller", token("call", SESSION), ("PERMISSION_DENIED", "")),
        (
            "forged",
            token("host", SESSION, secret=b"not the bridge's secret, long enough"),
            ("UNAUTHENTICATED", "bad_signature"),
        ),
        ("none", None, ("UNAUTHENTICATED", "missing")),
    ],
)
async def test_a_page_without_a_host_token_for_the_session_is_refused_typed(
    driver: BrowserDriver, stack: SecuredStack, tab: str, host_token: str | None, refusal: tuple[str, str]
) -> None:
    query = {"session": SESSION, "baseUrl": stack.web_url, "startTimeoutMs": "5000"}
    if host_token is not None:
        query["token"] = host_token
    opened = await driver.open(tab, query)
    assert opened["started"] is False
    assert f"the bridge refused the host: {refusal[0]}" in opened["startError"]
    errors = await driver.eval(tab, "window.toolmesh.errors")
    assert [(error["code"], error["cause"]) for error in errors] == [refusal]
    await driver.command("close", tab=tab)
