"""Serving the gateway: over stdio (one session), or streamable HTTP (one endpoint per session)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn
from mcp.server.context import ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.routing import Route

from toolmesh.core.bearer import bearer_token_of
from toolmesh.core.channels import is_loopback_host
from toolmesh.core.errors import Code
from toolmesh.mcp.gateway import Gateway
from toolmesh.mcp.mapping import refusal

log = logging.getLogger("toolmesh.mcp")

# The endpoint of a session: POST (and GET, DELETE) as streamable HTTP says.
ENDPOINT = "/sessions/{session_id}/mcp"
# An MCP session with no request in flight and no open GET stream for this long is closed (the MCP
# SDK's default, said here because it also ends the session's tools watch when it was the last).
MCP_SESSION_IDLE_S = 30 * 60.0
# The SDK's loggers that write MCP session ids ("Created new transport with session ID: ...").
SDK_SESSION_LOGGERS = ("mcp.server.streamable_http_manager", "mcp.server.streamable_http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_SESSION_ID = re.compile(r"[0-9a-fA-F]{32}")


class _NoSessionIds(logging.Filter):
    """Drops the SDK's log lines that quote an MCP session id: an id is a capability, never logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:
            return False
        return _SESSION_ID.search(text) is None


def keep_session_ids_out_of_logs() -> None:
    """Install the filter on the SDK's transport loggers (idempotent)."""
    for name in SDK_SESSION_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoSessionIds) for f in logger.filters):
            logger.addFilter(_NoSessionIds())


def _token_digest(authorization: str) -> str:
    """What an MCP session is bound to: a hash of the caller's bearer token ("" without one)."""
    token = bearer_token_of(authorization)
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


class SessionOwners:
    """Binds each MCP session id to the token that opened it.

    An MCP session id is a bearer capability the SDK hands out; alone it must not
    let anyone use or end (DELETE) the session. A request naming a session opened
    with another token, or with none when it was opened with one, is refused (403,
    the JSON-RPC error -32600 with `data.code` UNAUTHENTICATED or PERMISSION_DENIED)
    before the SDK sees it.
    """

    # Ids the SDK may have forgotten (idle timeout) are pruned when this many more are kept than live.
    PRUNE_SLACK = 1024

    def __init__(self, app: App, live: Callable[[], set[str]]) -> None:
        self._app = app
        self._live = live
        self._owners: dict[str, str] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        authorization = headers.get("authorization", "")
        digest = _token_digest(authorization)
        named = headers.get("mcp-session-id")
        if named is not None:
            owner = self._owners.get(named)
            if owner is not None and not hmac.compare_digest(owner, digest):
                code = Code.UNAUTHENTICATED if not bearer_token_of(authorization) else Code.PERMISSION_DENIED
                log.info(
                    "refused a request for an MCP session opened with another token",
                    extra={"code": code.value},
                )
                await _refuse(send, code)
                return

        async def recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._record(scope, named, digest, message)
            await send(message)

        await self._app(scope, receive, recording)

    def _record(self, scope: Scope, named: str | None, digest: str, message: Message) -> None:
        status: int = message["status"]
        if named is None:
            for key, value in message.get("headers", []):
                if key.lower() == b"mcp-session-id":
                    self._owners[value.decode("latin-1")] = digest
                    self._prune()
        elif status == 404 or (scope["method"] == "DELETE" and 200 <= status < 300):
            self._owners.pop(named, None)

    def _prune(self) -> None:
        live = self._live()
        if len(self._owners) > len(live) + self.PRUNE_SLACK:
            self._owners = {key: value for key, value in self._owners.items() if key in live}


async def _refuse(send: Send, code: Code) -> None:
    error = refusal(code)
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": None,
            "error": {"code": error.error.code, "message": error.error.message, "data": error.error.data},
        }
    ).encode()
    await send(
        {"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def serve_stdio(gateway: Gateway) -> None:
    """Serve one MCP client on this process's stdin and stdout until it closes them."""
    async with stdio_server() as (read_stream, write_stream):
        await gateway.server.run(read_stream, write_stream, gateway.server.create_initialization_options())


def session_of_path(ctx: ServerRequestContext[Any, Any]) -> str:
    """The session an HTTP request names in its path."""
    request = ctx.request
    session_id: str = request.path_params["session_id"] if request is not None else ""
    return session_id


def token_of_header(ctx: ServerRequestContext[Any, Any]) -> str | None:
    """The bearer token of an HTTP request's Authorization header (None without one)."""
    request = ctx.request
    header: str = request.headers.get("authorization", "") if request is not None else ""
    return bearer_token_of(header) or None


def security_settings(host: str, allowed_origins: list[str]) -> TransportSecuritySettings:
    """The SDK's DNS-rebinding protection: Host and Origin headers checked on every request.

    On loopback, loopback names and origins are allowed (with `allowed_origins`);
    elsewhere, the bound host and the given origins.
    """
    if is_loopback_host(host):
        hosts = ["127.0.0.1:*", "localhost:*", "[::1]:*"]
        origins = ["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"]
    else:
        hosts = [f"{host}:*"]
        origins = []
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=hosts,
        allowed_origins=origins + allowed_origins,
    )


def http_app(gateway: Gateway, settings: TransportSecuritySettings) -> Starlette:
    """The ASGI app: /sessions/{session_id}/mcp, one streamable HTTP endpoint per session."""
    keep_session_ids_out_of_logs()
    manager = StreamableHTTPSessionManager(
        app=gateway.server, security_settings=settings, session_idle_timeout=MCP_SESSION_IDLE_S
    )

    def live() -> set[str]:
        return set(getattr(manager, "_server_instances", {}))

    return Starlette(
        routes=[Route(ENDPOINT, endpoint=SessionOwners(StreamableHTTPASGIApp(manager), live))],
        lifespan=lambda _app: manager.run(),
    )


async def serve_http(
    gateway: Gateway,
    host: str,
    port: int,
    *,
    allowed_origins: list[str],
    on_listening: Callable[[int], None],
    stop: asyncio.Event,
) -> None:
    """Serve HTTP on host:port (0: a free port, told to `on_listening`) until `stop` is set."""
    app = http_app(gateway, security_settings(host, allowed_origins))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # Listening before uvicorn starts: a client that connects at once waits in the backlog.
    sock.listen(2048)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    serving = asyncio.create_task(server.serve([sock]))
    on_listening(sock.getsockname()[1])
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopping.cancel()
    await serving
