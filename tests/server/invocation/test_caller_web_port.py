"""The caller RPCs on toolmesh up's web port, over raw HTTP: Connect JSON and gRPC-Web."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator

import httpx
import pytest

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.auth.tokens import SharedSecret, Verifier
from toolmesh.runtime.security import Security
from toolmesh.v1 import registry_pb2
from trust_testing import SECRET, token

ALLOWED = "http://app.example"
CALLS = [
    ("/toolmesh.v1.RegistryService/ListTools", {"sessionId": "s1"}),
    ("/toolmesh.v1.RegistryService/GetTool", {"sessionId": "s1", "name": "nope"}),
    (
        "/toolmesh.v1.InvocationService/InvokeTool",
        {"sessionId": "s1", "toolName": "nope", "argumentsJson": "{}"},
    ),
    ("/toolmesh.v1.InvocationService/GetInvocation", {"toolRequestId": "tr_x"}),
    ("/toolmesh.v1.InvocationService/ConfirmDelivery", {"toolRequestIds": ["tr_x"]}),
    ("/toolmesh.v1.InvocationService/CancelInvocation", {"toolRequestId": "tr_x"}),
]


@pytest.fixture
async def system() -> AsyncIterator[LocalSystem]:
    running = await start_local_system(
        web_origins=[ALLOWED], security=Security(verifier=Verifier(SharedSecret(SECRET)))
    )
    yield running
    await running.stop(0)


@pytest.fixture
async def http(system: LocalSystem) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=system.web_url, timeout=10) as client:
        yield client


def _reason(response: httpx.Response) -> str:
    detail = response.json()["details"][0]
    assert detail["type"] == "google.rpc.ErrorInfo"
    raw = base64.b64decode(detail["value"] + "=" * (-len(detail["value"]) % 4))
    return raw.decode("latin-1")


@pytest.mark.integration
@pytest.mark.parametrize(("path", "body"), CALLS)
async def test_an_allowed_origin_with_a_call_token_is_served(
    http: httpx.AsyncClient, path: str, body: dict[str, object]
) -> None:
    headers = {"origin": ALLOWED, "authorization": f"Bearer {token('call', 's1')}"}
    response = await http.post(path, json=body, headers=headers)
    assert response.headers["access-control-allow-origin"] == ALLOWED
    # Admitted: the answer is the domain's (a tool or an invocation it does not know), never a refusal.
    if response.status_code != 200:
        assert "PERMISSION_DENIED" not in _reason(response) and "UNAUTHENTICATED" not in _reason(response)


@pytest.mark.integration
@pytest.mark.parametrize(("path", "body"), CALLS[:3])
async def test_refusals_are_typed(http: httpx.AsyncClient, path: str, body: dict[str, object]) -> None:
    good = {"authorization": f"Bearer {token('call', 's1')}"}
    assert (
        await http.post(path, json=body, headers=good | {"origin": "http://evil.example"})
    ).status_code == 403
    rebinding = await http.post(path, json=body, headers=good | {"host": "evil.example"})
    assert rebinding.status_code == 403 and rebinding.json()["code"] == "permission_denied"
    none = await http.post(path, json=body)
    assert none.json()["code"] == "unauthenticated"
    wrong = await http.post(path, json=body, headers={"authorization": f"Bearer {token('call', 's2')}"})
    assert wrong.json()["code"] == "permission_denied"
    if "InvocationService" in path:  # a host may read its session's tools (the policy's READERS), not call
        host = await http.post(path, json=body, headers={"authorization": f"Bearer {token('host', 's1')}"})
        assert host.json()["code"] == "permission_denied"


@pytest.mark.integration
async def test_list_tools_over_grpc_web(http: httpx.AsyncClient) -> None:
    message = registry_pb2.ListToolsRequest(session_id="s1").SerializeToString()
    response = await http.post(
        "/toolmesh.v1.RegistryService/ListTools",
        content=struct.pack(">BI", 0, len(message)) + message,
        headers={
            "content-type": "application/grpc-web+proto",
            "origin": ALLOWED,
            "authorization": f"Bearer {token('call', 's1')}",
        },
    )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert b"grpc-status:0" in response.content.replace(b" ", b"")


@pytest.mark.integration
@pytest.mark.parametrize(
    "path", ["/toolmesh.v1.InvocationService/InvokeTools", "/toolmesh.v1.RegistryService/PutTools"]
)
async def test_internal_and_write_rpcs_are_not_served(http: httpx.AsyncClient, path: str) -> None:
    assert (await http.post(path, json={}, headers={"origin": ALLOWED})).status_code == 404
