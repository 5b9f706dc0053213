"""A web port: RPCs over Connect and gRPC-Web on HTTP/1.1, for pages (the bridge's host RPCs, the
caller RPCs of the registry and the invocation service).

What every web port shares: the ASGI application around the generated Connect routes (every
refusal typed, with ErrorInfo as on the gRPC port), the checks before any RPC runs and the server.

Who may call: as on the gRPC port (the same policy and tokens, `authorization: Bearer <token>`,
a header browsers may send here), and TLS with the service's certificate when it has one. Only
the RPCs a port is given are served (any other path is 404). A browser page may call only from
an origin it is allowed: one of the configured origins, or the port's own origin; a request from
another origin is refused (403) before any RPC runs, and preflights for it get no CORS grant.
Requests without an Origin header (not from a browser) are served.

Health: `GET /healthz` (or HEAD) answers 200 `SERVING`, or 503 `NOT_SERVING` once the process is
stopping, as the gRPC port's standard health service does: for a load balancer or an
orchestrator in front of the web port, and for a page's host SDK choosing among bridge replicas
(a frozen one accepts the connection and answers nothing). Anyone who may reach the port may ask
(no token: it says nothing else), under the same Host and origin checks; any other method is 405.

DNS rebinding: every request's `Host` must name this port as configured (the loopback names
localhost, 127.0.0.1 and [::1], the bound address, the hosts of the allowed origins and
`--web-hosts`), else 403 (PERMISSION_DENIED) before anything else; a rebinding page, whose Host
is its own name, never reaches the origin check that trusts the port's own origin.

Slow clients: a request must arrive whole (headers and body) within REQUEST_READ_S of its
connection opening or of the previous response, an idle keep-alive connection closes after
KEEP_ALIVE_S, and at most MAX_CONNECTIONS connections (MAX_CONNECTIONS_PER_ADDRESS from one
client address) are open at once; a connection over either is closed as it opens.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextvars
import json
import logging
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

import uvicorn
from connectrpc._protocol import HTTPError
from connectrpc.code import Code as ConnectCode
from connectrpc.compat import google_protobuf_codecs
from connectrpc.errors import ConnectError, ErrorDetail
from connectrpc.request import RequestContext
from connectrpc.server import ConnectASGIApplication
from google.rpc import error_details_pb2
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from protobuf.wkt import Any as AnyMessage
from uvicorn.protocols.http.h11_impl import H11Protocol

from toolmesh.auth.guard import Admit
from toolmesh.core import telemetry
from toolmesh.core.errors import DOMAIN, Code, ToolmeshError, typed_error
from toolmesh.core.limits import MAX_MESSAGE_BYTES
from toolmesh.core.tls import TlsFiles
from toolmesh.runtime import store_errors
from toolmesh.runtime.decoding import undecodable
from toolmesh.runtime.server import CannotListen

log = logging.getLogger("toolmesh.runtime.web")

ORIGINS_ENV = "TOOLMESH_WEB_ORIGINS"
HOSTS_ENV = "TOOLMESH_WEB_HOSTS"
# The names a request's Host may give on any port: this machine's loopback names.
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
HOST_REFUSED = "The request's Host is not a name of this port."

# A request (its headers and body) must have arrived this long after its connection opened or the
# previous response ended; a half-sent request (slowloris) is closed then.
REQUEST_READ_S = 10.0
# An idle keep-alive connection is closed after this long (uvicorn's timeout_keep_alive).
KEEP_ALIVE_S = 5.0
# Open connections at most, on the port and from one client address (one per page's host session,
# and a few for its calls: a browser opens at most 6 per origin and tab).
MAX_CONNECTIONS = 1000
MAX_CONNECTIONS_PER_ADDRESS = 64
# The largest request head (request line and headers) read (h11's incomplete event size).
MAX_HEADER_BYTES = 16 * 1024

# The W3C trace context a request's headers may carry; a page that traces sends its span's.
_CONTEXT_HEADERS = ("traceparent", "tracestate", "baggage")
# What Connect and gRPC-Web clients send, the token a host will present, and trace context.
_ALLOWED_HEADERS = ", ".join(
    (
        "authorization, content-type, connect-protocol-version, connect-timeout-ms",
        "connect-accept-encoding, connect-content-encoding, grpc-timeout, x-grpc-web, x-user-agent",
        *_CONTEXT_HEADERS,
    )
)
# gRPC-Web sends a status without messages in headers, which a page may only read when exposed.
_EXPOSED_HEADERS = "grpc-status, grpc-message, grpc-status-details-bin, connect-content-encoding"

ConnectApp = TypeVar("ConnectApp", bound="ConnectASGIApplication[Any]")
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def connect_error(error: ToolmeshError) -> ConnectError:
    """The error a Connect or gRPC-Web client sees: the table's status, with ErrorInfo as on the gRPC port."""
    info = error_details_pb2.ErrorInfo(reason=error.code.value, domain=DOMAIN, metadata=error.metadata)
    detail = AnyMessage(type_url="type.googleapis.com/google.rpc.ErrorInfo", value=info.SerializeToString())
    # gRPC status names and Connect code names agree but for the spelling of CANCELLED.
    name = error.status.name.lower().replace("cancelled", "canceled")
    return ConnectError(ConnectCode(name), error.message, [ErrorDetail(detail)])


def fail(method: str, exc: Exception) -> NoReturn:
    if isinstance(exc, ConnectError):
        raise exc
    error = typed_error(exc, method, log)
    store_errors.count(method, error)
    raise connect_error(error) from None


class Headers:
    """A Connect request's headers where the policy reads gRPC metadata."""

    def __init__(self, ctx: RequestContext[Any, Any]) -> None:
        self._ctx = ctx

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [(key.lower(), value) for key, value in self._ctx.request_headers.items()]

    def peer(self) -> str:
        """The client's `host:port`, as the policy reads a gRPC peer."""
        return self._ctx.client_address or ""


async def admit(admit: Admit | None, request: Any, ctx: RequestContext[Any, Any]) -> None:
    if admit is not None:
        await admit(request, Headers(ctx))


def add_web_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--web-hosts",
        help=f"comma-separated names the web port is reached by besides loopback's and its allowed "
        f"origins', checked against each request's Host (DNS rebinding), e.g. bridge.example.com "
        f"(env {HOSTS_ENV}; default none)",
    )
    parser.add_argument(
        "--web-origins",
        help=f"comma-separated browser origins allowed on the web port besides its own, "
        f"e.g. http://localhost:5173 (env {ORIGINS_ENV}; default none)",
    )


def web_hosts(flag: str | None) -> list[str]:
    """The names (no port) a request's Host may give besides loopback's: the flag, else the environment."""
    raw = flag if flag is not None else os.environ.get(HOSTS_ENV, "")
    hosts = [host.strip().lower() for host in raw.split(",") if host.strip()]
    for host in hosts:
        if host == "*" or "/" in host or urlsplit(f"//{host}").port is not None:
            raise SystemExit(f"not a host name (a name or an address, no port): {host}")
    return hosts


def allowed_hosts(origins: Iterable[str], hosts: Iterable[str] = ()) -> frozenset[str]:
    """The names a request's Host may give: loopback's, the given hosts, and the allowed origins' hosts."""
    names = set(LOOPBACK_HOSTS)
    names.update(_bracketed(host.lower()) for host in hosts if host not in ("", "0.0.0.0", "::"))
    for origin in origins:
        hostname = urlsplit(origin).hostname
        if hostname:
            names.add(_bracketed(hostname))
    return frozenset(names)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def host_name(host_header: str) -> str:
    """The name of a Host header, without its port: `[::1]:7404` is `[::1]`, `Localhost:80` is `localhost`."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if ":" in host else host


def web_origins(flag: str | None) -> list[str]:
    """The allowed origins: the flag, else the environment, else none (never `*`)."""
    raw = flag if flag is not None else os.environ.get(ORIGINS_ENV, "")
    origins = [origin.strip().rstrip("/") for origin in raw.split(",") if origin.strip()]
    for origin in origins:
        parts = urlsplit(origin)
        if origin == "*" or parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
            raise SystemExit(f"not an origin (scheme://host[:port]): {origin}")
    return origins


def allowed_origin(origin: str, host_header: str, origins: frozenset[str]) -> bool:
    """A configured origin, or the port's own (the Host the request was sent to)."""
    return origin in origins or (host_header != "" and urlsplit(origin).netloc == host_header)


HEALTH_PATH = "/healthz"


def guarded(
    app: App,
    paths: Iterable[str] | WebRoutes,
    origins: Iterable[str],
    hosts: Iterable[str] = (),
    *,
    serving: Callable[[], bool] = lambda: True,
) -> App:
    """Only `paths` (the RPCs served) and HEALTH_PATH (`serving`: whether it says SERVING), only for
    a Host that names this port, and only from allowed origins, with CORS for those."""
    allowed = frozenset(origin.rstrip("/") for origin in origins)
    names = allowed_hosts(allowed, hosts)
    served = paths if isinstance(paths, WebRoutes) else frozenset(paths)

    async def guard(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        if host_name(headers.get("host", "")) not in names:
            # DNS rebinding: a page of another name that resolves here. Refused before its origin
            # is compared with the port's own (which it would match).
            log.info("refused a request for a host not allowed", extra={"code": Code.PERMISSION_DENIED.value})
            await _refuse(send, 403, ToolmeshError(Code.PERMISSION_DENIED, HOST_REFUSED))
            return
        if scope["path"] not in served and scope["path"] != HEALTH_PATH:
            await _respond(send, 404, [])
            return
        origin = headers.get("origin")
        cors: list[tuple[bytes, bytes]] = []
        if origin is not None:
            if not allowed_origin(origin, headers.get("host", ""), allowed):
                log.info("refused a request from an origin not allowed", extra={"origin": origin[:200]})
                await _respond(send, 403, [(b"vary", b"origin")])
                return
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"origin")]
        if scope["method"] == "OPTIONS":
            await _respond(
                send,
                204,
                [
                    *cors,
                    (b"access-control-allow-methods", b"POST, GET"),
                    (b"access-control-allow-headers", _ALLOWED_HEADERS.encode()),
                    (b"access-control-max-age", b"7200"),
                ],
            )
            return

        async def send_with_cors(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start" and cors:
                message["headers"] = [
                    *message.get("headers", []),
                    *cors,
                    (b"access-control-expose-headers", _EXPOSED_HEADERS.encode()),
                ]
            await send(message)

        if scope["path"] == HEALTH_PATH:
            await _health(send_with_cors, scope["method"], serving())
            return
        await app(scope, receive, send_with_cors)

    return guard


async def _health(send: Send, method: str, serving: bool) -> None:
    if method not in ("GET", "HEAD"):
        await _respond(send, 405, [(b"allow", b"GET, HEAD")])
        return
    body = b"SERVING\n" if serving else b"NOT_SERVING\n"
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"cache-control", b"no-store")]
    await send({"type": "http.response.start", "status": 200 if serving else 503, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body, "more_body": False})


async def _respond(send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _refuse(send: Send, status: int, error: ToolmeshError) -> None:
    """A refusal as the Connect protocol writes an error: its code, message and ErrorInfo."""
    info = error_details_pb2.ErrorInfo(reason=error.code.value, domain=DOMAIN, metadata=error.metadata)
    name = error.status.name.lower().replace("cancelled", "canceled")
    detail = {
        "type": "google.rpc.ErrorInfo",
        "value": base64.b64encode(info.SerializeToString()).decode().rstrip("="),
    }
    body = json.dumps({"code": name, "message": error.message, "details": [detail]}).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


PROTOCOL_ERROR_DETAIL = "The request does not follow the Connect or gRPC-Web protocol."
# What the Connect library refuses a request with, before or beside any RPC: a bad envelope
# (INVALID_ARGUMENT, or INTERNAL for a compressed message without an encoding), a bad timeout or
# protocol version header (INVALID_ARGUMENT), an unknown encoding or a request stream without
# exactly one message (UNIMPLEMENTED). Our own errors always carry ErrorInfo, so these never do.
_PROTOCOL_CODES = frozenset({ConnectCode.INVALID_ARGUMENT, ConnectCode.INTERNAL, ConnectCode.UNIMPLEMENTED})


def _typed_protocol_error(exc: Exception | None) -> Exception | None:
    """A protocol-level refusal as on the gRPC port: INVALID_REQUEST with ErrorInfo; any other error as it is.

    The library's own text is dropped: it can quote what was sent (a header's value).
    """
    unsupported = isinstance(exc, HTTPError) and exc.status is HTTPStatus.UNSUPPORTED_MEDIA_TYPE
    untyped = isinstance(exc, ConnectError) and not exc.details and exc.code in _PROTOCOL_CODES
    if unsupported or untyped:
        return connect_error(ToolmeshError(Code.INVALID_REQUEST, PROTOCOL_ERROR_DETAIL))
    return exc


class _TypedProtocolErrors:
    """A metadata interceptor: the refusals met once a request is under way (its body) get typed."""

    async def on_start(self, ctx: RequestContext[Any, Any]) -> None:
        return None

    async def on_end(self, token: None, ctx: RequestContext[Any, Any], error: Exception | None, /) -> None:
        typed = _typed_protocol_error(error)
        if typed is not error and typed is not None:
            raise typed  # an on_end exception replaces the request's error


# A started span and the token that made it current.
_Started = tuple[Any, "contextvars.Token[otel_context.Context]"]


class _ServerSpans:
    """A metadata interceptor: each RPC's SERVER span, as on the gRPC port (runtime/instrument.py).

    Named `package.Service/Method`, continuing the W3C trace context of the request's headers,
    current while the RPC runs; `rpc.system` is `connect_rpc`. No span at all when not tracing.
    """

    async def on_start(self, ctx: RequestContext[Any, Any]) -> _Started | None:
        if not telemetry.enabled():
            return None
        method = ctx.method
        headers = ctx.request_headers
        carrier = {key: value for key in _CONTEXT_HEADERS if (value := headers.get(key)) is not None}
        span = telemetry.TRACER.start_span(
            f"{method.service_name}/{method.name}",
            context=telemetry.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": "connect_rpc",
                "rpc.service": method.service_name,
                "rpc.method": method.name,
            },
            record_exception=False,
            set_status_on_exception=False,
        )
        return span, otel_context.attach(trace.set_span_in_context(span))

    async def on_end(
        self,
        token: _Started | None,
        ctx: RequestContext[Any, Any],
        error: Exception | None,
        /,
    ) -> None:
        if token is None:
            return
        span, attached = token
        if isinstance(error, ConnectError):
            # The table's code where the error carries ErrorInfo (ours always do), as on the gRPC port.
            span.set_attribute("rpc.connect_rpc.error_code", error.code.value)
            span.set_status(Status(StatusCode.ERROR, _reason(error) or error.code.value))
        elif error is not None:
            span.set_status(Status(StatusCode.ERROR, type(error).__qualname__))
        span.end()
        otel_context.detach(attached)


def _reason(error: ConnectError) -> str | None:
    """The ErrorInfo reason (the error table's code) an error carries, if any."""
    for detail in error.details:
        if detail.type_name == "google.rpc.ErrorInfo":
            return str(error_details_pb2.ErrorInfo.FromString(detail.message_bytes).reason)
    return None


def typed_application(base: type[ConnectApp]) -> type[ConnectApp]:
    """A generated Connect application class whose refusals met before a request is under way (its
    headers) get typed.

    Those reach no interceptor: _handle_error is where the library answers them
    (connectrpc is pinned to an exact version for this override).
    """

    class Typed(base):  # type: ignore[valid-type,misc]
        async def _handle_error(
            self,
            exc: Exception,
            ctx: RequestContext[Any, Any] | None,
            protocol: Any,
            send: Any,
        ) -> bool:
            typed = _typed_protocol_error(exc)
            assert typed is not None
            handled: bool = await super()._handle_error(typed, ctx, protocol, send)
            return handled

    Typed.__name__ = f"Typed{base.__name__}"
    return Typed


def connect_app(base: type[ConnectApp], service: Any, read_max_bytes: int = MAX_MESSAGE_BYTES) -> ConnectApp:
    """`service` as the generated application `base`, every refusal typed (ErrorInfo, as on the gRPC port)."""
    typed: Any = typed_application(base)  # a generated class: its own constructor, not the base's
    application: ConnectApp = typed(
        service,
        # Spans outermost: the span sees the typed error.
        interceptors=[_ServerSpans(), _TypedProtocolErrors()],
        read_max_bytes=read_max_bytes,
        codecs=[_TypedDecoding(codec) for codec in google_protobuf_codecs()],
    )
    return application


class WebRoutes:
    """The RPCs one web port serves, gathered from the services of one process: one origin for a
    page, whose host RPCs (the bridge) and caller RPCs (the registry's reads, the invocation
    service's calls) share it. An application (each request to its service's routes); `guarded`
    serves only the paths added."""

    def __init__(self) -> None:
        self._apps: dict[str, App] = {}
        self._paths: set[str] = set()

    def add(self, app: ConnectASGIApplication[Any], paths: Iterable[str]) -> None:
        self._apps[app.path] = app
        self._paths.update(paths)

    def __contains__(self, path: object) -> bool:
        return path in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        app = self._apps.get(path[: path.rfind("/")])
        if app is None or path not in self._paths:
            await _respond(send, 404, [])
            return
        await app(scope, receive, send)


class _TypedDecoding:
    """A codec whose undecodable messages fail as on the gRPC port: INVALID_REQUEST with ErrorInfo.

    The Connect library's own decoding error has no details; the error table decides this one.
    """

    def __init__(self, codec: Any) -> None:
        self._codec = codec

    def name(self) -> str:
        name: str = self._codec.name()
        return name

    def encode(self, message: Any) -> bytes:
        encoded: bytes = self._codec.encode(message)
        return encoded

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._codec.decode(data, message_class)
        except Exception:
            raise connect_error(undecodable()) from None


@dataclass
class WebServer:
    """A running web port."""

    server: uvicorn.Server
    port: int

    def stop_accepting(self) -> None:
        """Take no new connections (a page reconnecting must find the next bridge, not this one)."""
        for server in self.server.servers:
            server.close()

    async def stop(self, grace: float) -> None:
        self.server.config.timeout_graceful_shutdown = max(1, round(grace))
        self.server.should_exit = True
        await self.server.shutdown()


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a request may take to arrive, and how many connections may be open (see the module)."""

    request_read_s: float = REQUEST_READ_S
    keep_alive_s: float = KEEP_ALIVE_S
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS


def _bounded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, with the connection caps and the request read timeout of one port."""
    per_address: Counter[str] = Counter()

    class Bounded(H11Protocol):
        _address: str | None = None
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            address = self.client[0] if self.client else ""
            if (
                len(self.connections) > limits.max_connections
                or per_address[address] >= limits.max_connections_per_address
            ):
                log.warning(
                    "refused a connection over the web port's caps",
                    extra={"code": Code.OVERLOADED.value, "open_connections": len(self.connections)},
                )
                transport.abort()
                return
            per_address[address] += 1
            self._address = address
            self._arm_read_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_read_timer()
            if self._address is not None:
                per_address[self._address] -= 1
                if per_address[self._address] <= 0:
                    del per_address[self._address]
                self._address = None
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            cycle = self.cycle
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                self._disarm_read_timer()  # the request being served has arrived whole

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_read_timer()  # the next request, if any, within the same time

        def _arm_read_timer(self) -> None:
            self._disarm_read_timer()
            self._read_timer = self.loop.call_later(limits.request_read_s, self._read_timed_out)

        def _disarm_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if not self.transport.is_closing():
                log.info("closed a connection whose request did not arrive in time")
                self.transport.close()

    return Bounded


async def start_web_server(
    app: App, address: str, tls: TlsFiles | None = None, limits: ConnectionLimits | None = None
) -> WebServer:
    """Serve `app` on `address` (port 0 picks a free port) over HTTP/1.1, on the running loop.

    With `tls` (a certificate and key), over HTTPS; the files are read once, at start.
    `limits`: request read timeout, keep-alive and connection caps (default ConnectionLimits()).
    """
    limits = limits or ConnectionLimits()
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and an
    # accepted socket inherits this one's. Without it uvicorn's response head and body go apart,
    # the body held by Nagle's algorithm until the client's delayed ACK (~40 ms a request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError:
        sock.close()
        raise CannotListen(address) from None
    sock.setblocking(False)
    config = uvicorn.Config(
        app,
        http=_bounded_protocol(limits),
        timeout_keep_alive=max(1, round(limits.keep_alive_s)),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        ws="none",
        lifespan="off",
        interface="asgi3",
        log_config=None,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        ssl_certfile=tls.cert if tls is not None and tls.cert is not None else None,
        ssl_keyfile=tls.key if tls is not None and tls.key is not None else None,
    )
    server = uvicorn.Server(config)
    # startup() and shutdown(), not serve(): that would take over the process's signals.
    config.load()
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    return WebServer(server, sock.getsockname()[1])
