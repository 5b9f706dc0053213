"""Pages as handler hosts with tokens: the TypeScript SDK's `token` option, in a real Chromium.

The bridge requires signed tokens on its web port as on its gRPC port. A page
whose token names its session serves it; one whose token names another
session, or that has none, is refused with a typed error: `start()` rejects
naming the code, and `onError` hears of it. A page whose token callback gives
short-lived tokens keeps serving: its stream is replaced ahead of each expiry.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from browser_driver import BrowserDriver, build_test_page
from toolmesh.assembly.system import start_bridge, start_invocation, start_registry
from toolmesh.auth.tokens import SharedSecret, Verifier
from toolmesh.client import InvocationClient
from toolmesh.runtime.security import Security
from toolmesh.runtime.server import RunningServer
from trust_testing import SECRET, token

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


async def start_secured(driver: BrowserDriver, security: Security) -> SecuredStack:
    """The three services apart, with tokens: they share one service token for their internal ports."""
    security = security.with_service_token()
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
    return SecuredStack(registry, bridge, invocation)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(driver: BrowserDriver) -> AsyncIterator[SecuredStack]:
    running = await start_secured(driver, Security(verifier=Verifier(SharedSecret(SECRET))))
    yield running
    await running.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def expiring_stack(driver: BrowserDriver) -> AsyncIterator[SecuredStack]:
    """No leeway: a stream ends as its token expires, within the test."""
    running = await start_secured(driver, Security(verifier=Verifier(SharedSecret(SECRET), leeway_s=0)))
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


SHORT_S = 3.0


@pytest.mark.slow
async def test_a_page_with_refreshing_short_tokens_loses_no_call_across_expiries(
    driver: BrowserDriver, expiring_stack: SecuredStack
) -> None:
    """3 s tokens: the page's stream is replaced ahead of each expiry, and every call gets its result.

    Without renewal the stream would be cut at expiry and the calls arriving before
    the page reconnects would fail (no host).
    """
    session = "web-renewing"
    query = {
        "session": session,
        "baseUrl": expiring_stack.web_url,
        "token": token("host", session, ttl_s=SHORT_S),
    }
    assert await driver.open("renewing", query) == {"started": True, "startError": ""}
    host_sessions: set[str] = set()
    results = []
    async with InvocationClient(
        f"127.0.0.1:{expiring_stack.invocation.port}", token=token("call", session)
    ) as client:
        started = time.monotonic()
        n = 0
        while time.monotonic() - started < 3 * SHORT_S:
            # The page's token callback gives a fresh token from now on, as a page's refresh would.
            await driver.eval(
                "renewing", f"window.toolmesh.setToken({json.dumps(token('host', session, ttl_s=SHORT_S))})"
            )
            host_sessions.add(await driver.eval("renewing", "window.toolmesh.hostSessionId()"))
            batch = [client.invoke(session, "pause", {"n": n + i}, turn_id="t", timeout=10) for i in range(4)]
            results += await asyncio.gather(*batch)
            n += 4
    failures = [r for r in results if r.outcome is None or r.outcome.failure is not None]
    assert failures == []
    assert len(results) >= 40
    # The stream was replaced (a new host session) several times meanwhile, and nothing went wrong.
    assert len(host_sessions - {""}) >= 3
    assert await driver.eval("renewing", "window.toolmesh.errors") == []
    await driver.command("close", tab="renewing")
