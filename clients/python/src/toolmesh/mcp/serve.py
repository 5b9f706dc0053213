"""Serving the gateway: over stdio (one session), or streamable HTTP (one endpoint per session)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
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
from toolmesh.mcp.gateway import Gateway

# The endpoint of a session: POST (and GET, DELETE) as streamable HTTP says.
ENDPOINT = "/sessions/{session_id}/mcp"
# An MCP session with no request in flight and no open GET stream for this long is closed (the MCP
# SDK's default, said here because it also ends the session's tools watch when it was the last).
MCP_SESSION_IDLE_S = 30 * 60.0


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
    manager = StreamableHTTPSessionManager(
        app=gateway.server, security_settings=settings, session_idle_timeout=MCP_SESSION_IDLE_S
    )
    return Starlette(
        routes=[Route(ENDPOINT, endpoint=StreamableHTTPASGIApp(manager))],
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
