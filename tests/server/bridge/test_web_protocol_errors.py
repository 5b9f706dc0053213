"""Requests the Connect or gRPC-Web protocol refuses, sent to the web port by a raw HTTP client.

Whatever the protocol layer refuses before any RPC runs (a bad envelope, a bad
timeout header, a content type or encoding it does not take, a stream with no
request in it) fails as on the gRPC port: INVALID_ARGUMENT with ErrorInfo
INVALID_REQUEST, never an untyped status, and never echoing what was sent.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2, status_pb2

from toolmesh.assembly.system import LocalSystem, start_local_system

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SERVICE = "/toolmesh.v1.BridgeService/"
UNARY = SERVICE + "SubmitToolResult"
STREAM = SERVICE + "OpenHostSession"
SUBMIT = b'{"hostSessionId": "hs_secret-42", "toolRequestId": "tr_x", "outcome": {"resultJson": "1"}}'
OPEN = b'{"sessionId": "secret-42", "hostName": "raw"}'


def envelope(payload: bytes, flags: int = 0, length: int | None = None) -> bytes:
    return struct.pack(">BI", flags, len(payload) if length is None else length) + payload


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system() -> AsyncIterator[LocalSystem]:
    running = await start_local_system(heartbeat_s=0.3)
    yield running
    await running.stop(0.2)


@pytest_asyncio.fixture(loop_scope="module")
async def http(system: LocalSystem) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=system.web_url, timeout=10) as client:
        yield client


def frames(body: bytes) -> list[tuple[int, bytes]]:
    found = []
    while len(body) >= 5:
        flags, length = struct.unpack(">BI", body[:5])
        found.append((flags, body[5 : 5 + length]))
        body = body[5 + length :]
    return found


def connect_error(error: dict[str, object]) -> tuple[str, list[error_details_pb2.ErrorInfo]]:
    infos = []
    for detail in error.get("details", []):  # type: ignore[attr-defined]
        assert detail["type"] == "google.rpc.ErrorInfo"
        infos.append(error_details_pb2.ErrorInfo.FromString(base64.b64decode(detail["value"] + "==")))
    return str(error["code"]), infos


def grpc_web_error(fields: dict[str, str]) -> tuple[str, list[error_details_pb2.ErrorInfo]]:
    status = status_pb2.Status.FromString(base64.b64decode(fields.get("grpc-status-details-bin", "") + "=="))
    infos = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        assert detail.Unpack(info)
        infos.append(info)
    return fields["grpc-status"], infos


def refusal(response: httpx.Response) -> tuple[str, list[error_details_pb2.ErrorInfo]]:
    """The status a Connect or gRPC-Web client would read from `response`, and its ErrorInfo."""
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("application/json"):
        return connect_error(response.json())
    if content_type.startswith("application/connect"):
        (end,) = [payload for flags, payload in frames(response.content) if flags & 0x02]
        return connect_error(json.loads(end)["error"])
    if "grpc-status" in response.headers:
        return grpc_web_error(dict(response.headers))
    if content_type.startswith("application/grpc-web"):
        (trailers,) = [payload for flags, payload in frames(response.content) if flags & 0x80]
        lines = [line.split(":", 1) for line in trailers.decode().split("\r\n") if line]
        return grpc_web_error({key.strip().lower(): value.strip() for key, value in lines})
    return f"http {response.status_code}", []


CONNECT_JSON = {"content-type": "application/json"}
CONNECT_STREAM = {"content-type": "application/connect+json"}
GRPC_WEB = {"content-type": "application/grpc-web+json", "x-grpc-web": "1"}

CASES = {
    "connect timeout not a number": (UNARY, CONNECT_JSON | {"connect-timeout-ms": "soon"}, SUBMIT),
    "connect timeout over 10 digits": (UNARY, CONNECT_JSON | {"connect-timeout-ms": "12345678901"}, SUBMIT),
    "connect protocol version": (UNARY, CONNECT_JSON | {"connect-protocol-version": "2"}, SUBMIT),
    "content type not served": (UNARY, {"content-type": "text/plain"}, SUBMIT),
    "unknown content encoding": (UNARY, CONNECT_JSON | {"content-encoding": "secret-42"}, SUBMIT),
    "stream envelope flags": (STREAM, CONNECT_STREAM, envelope(OPEN, flags=0x40)),
    "stream envelope truncated": (STREAM, CONNECT_STREAM, envelope(OPEN, length=len(OPEN) + 100)),
    "stream compressed without encoding": (STREAM, CONNECT_STREAM, envelope(OPEN, flags=0x01)),
    "stream with no request": (STREAM, CONNECT_STREAM, b""),
    "stream with two requests": (STREAM, CONNECT_STREAM, envelope(OPEN) + envelope(OPEN)),
    "stream unknown encoding": (
        STREAM,
        CONNECT_STREAM | {"connect-content-encoding": "secret-42"},
        envelope(OPEN),
    ),
    "grpc-web timeout unit": (STREAM, GRPC_WEB | {"grpc-timeout": "5X"}, envelope(OPEN)),
    "grpc-web timeout not a number": (STREAM, GRPC_WEB | {"grpc-timeout": "soonS"}, envelope(OPEN)),
    "grpc-web envelope truncated": (UNARY, GRPC_WEB, envelope(SUBMIT, length=len(SUBMIT) + 9)),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_protocol_error_is_a_typed_invalid_request(http: httpx.AsyncClient, case: str) -> None:
    path, headers, body = CASES[case]
    response = await http.post(path, content=body, headers=headers)
    code, infos = refusal(response)
    assert code in ("invalid_argument", "3"), (case, code, response.status_code)
    assert [(info.reason, info.domain) for info in infos] == [("INVALID_REQUEST", "toolmesh")]
    assert "secret-42" not in response.text and "secret-42" not in str(response.headers)
