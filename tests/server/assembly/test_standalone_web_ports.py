"""The web ports of the standalone registry and invocation service (`--web-listen`), as processes.

Each serves its caller RPCs for pages as `toolmesh up`'s web port does, with the bridge's flags:
off by default, an allowed origin only (never `*`), a token of the call's own session only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from toolmesh_testing import (
    ServiceProcess,
    closed_address,
    environment_without_settings,
    refused_start,
    start_service_process,
)
from trust_testing import SECRET, token

pytestmark = pytest.mark.integration

ALLOWED = "http://app.example"
SERVICE_TOKEN = "a-service-token-shared-by-the-tests-services"
INVOKE = {"sessionId": "s1", "turnId": "t1", "toolName": "nope", "argumentsJson": "{}"}
# Per service: its extra arguments, and a call of session s1 the web port serves, whose answer is
# the domain's (a list; an unreachable registry) when admitted.
CALLS = {
    "registry": ((), "/toolmesh.v1.RegistryService/ListTools", {"sessionId": "s1"}),
    "invocation": (
        ("--registry", closed_address(), "--bridge", closed_address()),
        "/toolmesh.v1.InvocationService/InvokeTool",
        INVOKE,
    ),
}


def _env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    clean = environment_without_settings()
    token_file = tmp_path / "service-token"
    token_file.write_text(SERVICE_TOKEN + "\n")
    return clean | {"TOOLMESH_AUTH_SECRET": SECRET.decode()}, token_file


@pytest.fixture(params=sorted(CALLS))
async def service(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[str, ServiceProcess]]:
    name: str = request.param
    env, token_file = _env(tmp_path)
    running = await start_service_process(
        name,
        *CALLS[name][0],
        "--service-token-file",
        str(token_file),
        "--web-listen",
        "127.0.0.1:0",
        "--web-origins",
        ALLOWED,
        env=env,
    )
    yield name, running
    await running.stop()


async def test_an_allowed_origin_with_its_sessions_token_is_served(
    service: tuple[str, ServiceProcess],
) -> None:
    name, running = service
    _, path, body = CALLS[name]
    assert running.web_port is not None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.web_port}", timeout=10) as http:
        headers = {"origin": ALLOWED, "authorization": f"Bearer {token('call', 's1')}"}
        response = await http.post(path, json=body, headers=headers)
        assert response.headers["access-control-allow-origin"] == ALLOWED
        # Admitted: a session's list, or the call's own failure (no registry); never a refusal.
        assert response.status_code == 200 or response.json()["code"] == "unavailable", response.text


async def test_a_disallowed_origin_and_another_sessions_token_are_refused(
    service: tuple[str, ServiceProcess],
) -> None:
    name, running = service
    _, path, body = CALLS[name]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.web_port}", timeout=10) as http:
        own = {"authorization": f"Bearer {token('call', 's1')}"}
        evil = await http.post(path, json=body, headers=own | {"origin": "http://evil.example"})
        assert evil.status_code == 403 and "access-control-allow-origin" not in evil.headers
        preflight = await http.options(path, headers={"origin": "http://evil.example"})
        assert "access-control-allow-origin" not in preflight.headers
        other = {"origin": ALLOWED, "authorization": f"Bearer {token('call', 's2')}"}
        assert (await http.post(path, json=body, headers=other)).json()["code"] == "permission_denied"
        assert (await http.post(path, json=body, headers={"origin": ALLOWED})).json()[
            "code"
        ] == "unauthenticated"
        # Only the caller RPCs: an internal or write RPC is not there.
        internal = (
            "/toolmesh.v1.RegistryService/PutTools"
            if name == "registry"
            else "/toolmesh.v1.InvocationService/InvokeTools"
        )
        assert (await http.post(internal, json={}, headers=own | {"origin": ALLOWED})).status_code == 404


@pytest.mark.parametrize("name", sorted(CALLS))
async def test_the_web_port_is_off_by_default_and_never_allows_every_origin(
    name: str, tmp_path: Path
) -> None:
    env, token_file = _env(tmp_path)
    running = await start_service_process(
        name, *CALLS[name][0], "--service-token-file", str(token_file), env=env
    )
    try:
        assert running.web_port is None and not any("serves pages" in line for line in running.output)
    finally:
        await running.stop()
    code, stderr = await refused_start(
        name, *CALLS[name][0], "--web-listen", "127.0.0.1:0", "--web-origins", "*", env=env
    )
    assert code != 0 and "not an origin" in stderr
