"""The bridge's web port from outside a browser: what it serves, to whom, and how it fails."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import pytest
from google.rpc import error_details_pb2

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.bridge.web import allowed_hosts, host_name, web_hosts, web_origins
from toolmesh_testing import eventually

ALLOWED = "http://app.example:5173"
SERVICE = "/toolmesh.v1.BridgeService/"


@pytest.fixture
async def system() -> AsyncIterator[LocalSystem]:
    running = await start_local_system(heartbeat_s=0.3, web_origins=[ALLOWED])
    yield running
    await running.stop(0.2)


@pytest.fixture
async def http(system: LocalSystem) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=system.web_url, timeout=10) as client:
        yield client


SUBMIT = {"hostSessionId": "hs_x", "toolRequestId": "tr_x", "outcome": {"resultJson": "1"}}


@pytest.mark.integration
@pytest.mark.parametrize("method", ["DispatchToolRequest", "DispatchToolRequests", "NoSuchMethod"])
async def test_only_the_host_facing_rpcs_are_served(http: httpx.AsyncClient, method: str) -> None:
    for content_type in ("application/json", "application/grpc-web+proto", "application/connect+proto"):
        response = await http.post(SERVICE + method, content=b"{}", headers={"content-type": content_type})
        assert response.status_code == 404
    # The caller RPCs share toolmesh up's web port, but never the stream a browser cannot send, nor writes.
    for path in ("/toolmesh.v1.InvocationService/InvokeTools", "/toolmesh.v1.RegistryService/PutTools"):
        assert (await http.post(path, json={})).status_code == 404


@pytest.mark.integration
async def test_a_failed_call_carries_the_tables_status_and_error_info(http: httpx.AsyncClient) -> None:
    response = await http.post(SERVICE + "SubmitToolResult", json=SUBMIT)
    assert response.status_code == 404
    body = response.json()
    assert body["code"] == "not_found"
    assert body["message"] == "The host session does not exist or has ended."
    (detail,) = body["details"]
    assert detail["type"] == "google.rpc.ErrorInfo"
    info = error_details_pb2.ErrorInfo.FromString(base64.b64decode(detail["value"] + "=="))
    assert (info.reason, info.domain) == ("HOST_SESSION_UNKNOWN", "toolmesh")
    assert dict(info.metadata) == {"hostSessionId": "hs_x", "toolRequestId": "tr_x"}


@pytest.mark.integration
async def test_a_malformed_request_is_refused_without_echoing_it(http: httpx.AsyncClient) -> None:
    response = await http.post(
        SERVICE + "SubmitToolResult", json={"hostSessionId": "hs_x", "toolRequestId": "tr_x", "outcome": {}}
    )
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_argument"
    garbage = await http.post(
        SERVICE + "SubmitToolResult",
        content=b"{not json secret-42",
        headers={"content-type": "application/json"},
    )
    assert garbage.status_code == 400 and "secret-42" not in garbage.text


@pytest.mark.integration
async def test_origins_not_allowed_are_refused_before_any_rpc(
    http: httpx.AsyncClient, system: LocalSystem
) -> None:
    for origin in ("http://evil.example", "null", "http://app.example:5174"):
        refused = await http.post(SERVICE + "SubmitToolResult", json=SUBMIT, headers={"origin": origin})
        assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
        preflight = await http.options(
            SERVICE + "OpenHostSession",
            headers={"origin": origin, "access-control-request-method": "POST"},
        )
        assert "access-control-allow-origin" not in preflight.headers


@pytest.mark.integration
async def test_allowed_and_same_origin_pages_get_cors(http: httpx.AsyncClient, system: LocalSystem) -> None:
    for origin in (ALLOWED, system.web_url):
        preflight = await http.options(
            SERVICE + "OpenHostSession",
            headers={
                "origin": origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type,connect-protocol-version",
            },
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == origin
        assert "connect-protocol-version" in preflight.headers["access-control-allow-headers"]
        call = await http.post(SERVICE + "SubmitToolResult", json=SUBMIT, headers={"origin": origin})
        assert call.status_code == 404  # served: the host session is unknown
        assert call.headers["access-control-allow-origin"] == origin
        assert "grpc-status" in call.headers["access-control-expose-headers"]


@pytest.mark.integration
async def test_a_host_session_over_connect_streaming(http: httpx.AsyncClient) -> None:
    request = json.dumps({"sessionId": "plain"}).encode()
    envelope = b"\x00" + len(request).to_bytes(4, "big") + request
    async with http.stream(
        "POST",
        SERVICE + "OpenHostSession",
        content=envelope,
        headers={"content-type": "application/connect+json"},
    ) as response:
        assert response.status_code == 200
        chunks = response.aiter_bytes()
        first = await anext(chunks)
    assert json.loads(first[5:])["opened"]["heartbeatIntervalMs"] == 300


@pytest.mark.unit
def test_configured_origins_never_include_a_wildcard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOOLMESH_WEB_ORIGINS", raising=False)
    assert web_origins(None) == []
    monkeypatch.setenv("TOOLMESH_WEB_ORIGINS", "http://a.example, https://b.example:8443/")
    assert web_origins(None) == ["http://a.example", "https://b.example:8443"]
    assert web_origins("http://c.example") == ["http://c.example"]
    for bad in ("*", "a.example", "http://a.example/path", "ftp://a.example"):
        with pytest.raises(SystemExit):
            web_origins(bad)


@pytest.mark.integration
async def test_a_dns_rebinding_page_is_refused_even_without_tokens(
    http: httpx.AsyncClient, system: LocalSystem
) -> None:
    """Finding 5: a page at rebind.evil.example (resolving to 127.0.0.1) sends its own name as Host and
    Origin, which matched "the port's own origin"; its Host is not a name of this port: 403, typed."""
    port = urlsplit(system.web_url).port
    rebound = f"rebind.evil.example:{port}"
    request = json.dumps({"sessionId": "victim"}).encode()
    for path, content, content_type in (
        ("OpenHostSession", b"\x00" + len(request).to_bytes(4, "big") + request, "application/connect+json"),
        ("SubmitToolResult", json.dumps(SUBMIT).encode(), "application/json"),
    ):
        for origin in (f"http://{rebound}", None):
            headers = {"host": rebound, "content-type": content_type}
            if origin is not None:
                headers["origin"] = origin
            refused = await http.post(SERVICE + path, content=content, headers=headers)
            assert refused.status_code == 403
            assert "access-control-allow-origin" not in refused.headers
            body = refused.json()
            assert body["code"] == "permission_denied"
            info = error_details_pb2.ErrorInfo.FromString(
                base64.b64decode(body["details"][0]["value"] + "==")
            )
            assert info.reason == "PERMISSION_DENIED"
    # The port's loopback names, and the allowed origin's host, are served.
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "app.example:5173"):
        served = await http.post(SERVICE + "SubmitToolResult", json=SUBMIT, headers={"host": host})
        assert served.status_code == 404  # served: the host session is unknown


@pytest.mark.unit
def test_host_names_are_read_without_their_port(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [host_name(h) for h in ("[::1]:7404", "LocalHost:80", "127.0.0.1", "")] == [
        "[::1]",
        "localhost",
        "127.0.0.1",
        "",
    ]
    assert allowed_hosts(["https://app.example.com:8443"], ["bridge.example", "::2", "0.0.0.0"]) == {
        "localhost",
        "127.0.0.1",
        "[::1]",
        "app.example.com",
        "bridge.example",
        "[::2]",
    }
    monkeypatch.setenv("TOOLMESH_WEB_HOSTS", "a.example, b.example")
    assert web_hosts(None) == ["a.example", "b.example"]
    for bad in ("*", "a.example:80", "http://a.example"):
        with pytest.raises(SystemExit):
            web_hosts(bad)


@pytest.mark.integration
async def test_the_health_check_says_serving_to_anyone_who_may_reach_the_port(
    http: httpx.AsyncClient, system: LocalSystem
) -> None:
    """No token (the services here verify none, but the answer needs none anywhere): it says SERVING
    and nothing else, with CORS for an allowed page; the port's Host and origin checks still hold."""
    plain = await http.get("/healthz")
    assert (plain.status_code, plain.text) == (200, "SERVING\n")
    assert plain.headers["cache-control"] == "no-store"
    page = await http.get("/healthz", headers={"origin": ALLOWED})
    assert page.status_code == 200 and page.headers["access-control-allow-origin"] == ALLOWED
    head = await http.head("/healthz")
    assert head.status_code == 200 and head.content == b""
    refused = await http.get("/healthz", headers={"origin": "https://evil.example"})
    assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
    port = urlsplit(system.web_url).port
    rebound = await http.get("/healthz", headers={"host": f"rebind.evil.example:{port}"})
    assert rebound.status_code == 403
    for method in ("POST", "PUT", "DELETE"):
        wrong = await http.request(method, "/healthz", content=b"{}")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, HEAD"
    assert (await http.get("/healthz/more")).status_code == 404


@pytest.mark.integration
async def test_the_health_check_says_not_serving_once_the_bridge_stops(system: LocalSystem) -> None:
    """From the moment its stop begins: held in its services' shutdown here (where the bridge tells
    its hosts to go), the web port still up, it answers 503."""
    released = asyncio.Event()
    first = system.bridge.services[0]

    async def held() -> None:
        await released.wait()
        if first.on_shutdown is not None:
            await first.on_shutdown()

    system.bridge.services = [dataclasses.replace(first, on_shutdown=held), *system.bridge.services[1:]]
    async with httpx.AsyncClient(base_url=system.web_url, timeout=10) as client:
        assert (await client.get("/healthz")).status_code == 200
        stopping = asyncio.create_task(system.bridge.stop(0.5))
        await eventually(lambda: system.bridge.draining, timeout=5)
        answer = await client.get("/healthz")
        released.set()
        await stopping
    assert (answer.status_code, answer.text) == (503, "NOT_SERVING\n")
