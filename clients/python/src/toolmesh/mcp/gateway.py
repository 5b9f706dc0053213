"""The MCP gateway: a session's tools served to MCP clients, on the SDK's low-level server.

tools/list reads the registry; tools/call is an InvokeTool with the ledger's
semantics, so an MCP client's retry of a call (a new JSON-RPC id, the same
tool and arguments) joins the running invocation or replays its outcome
instead of running the tool again. The gateway never confirms delivery (MCP
has no way to say a result arrived): an identical call within the replay
window (10 minutes by default) replays, one in the 30 minutes after is refused
(RETRY_WINDOW_PASSED), and a client that means to run a tool again with the
same arguments sends another `toolmesh/idempotencyKey` in `_meta`.

When the session's tools change (WatchTools), connected clients are told:
notifications/tools/list_changed on handshake-era connections, a
ToolsListChanged event on `subscriptions/listen` streams (2026-07-28).
One watch per session, held by its open MCP sessions (handshake-era
connections) and listen streams: when the last of them closes (DELETE, the
transport's idle timeout, stdio closed), the watch ends. A watch that nothing
holds (opened by a 2026-07-28 request, which has no connection) ends after
WATCH_IDLE_S without requests. At most `max_watches` watches live at once: a
request that would open one more first ends the watches nothing holds, and is
refused with OVERLOADED (retryable) when every watch is held.

Who may call: the caller's own bearer token goes to the registry and the
invocation service with each request (over HTTP, its Authorization header;
over stdio, the gateway's --token); the services decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import grpc
import mcp_types as types
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp.shared.exceptions import MCPError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from toolmesh.client.invocation import CallResult, InvocationClient
from toolmesh.client.registry import RegistryClient
from toolmesh.core.errors import ERROR_TABLE, Code
from toolmesh.core.progress import ToolProgress
from toolmesh.core.rpcstatus import error_code
from toolmesh.mcp.mapping import META_IDEMPOTENCY_KEY, call_tool_result, mcp_tool, refusal, refused
from toolmesh.mcp.tasks import TaskMiddleware, capabilities, extensions
from toolmesh.mcp.telemetry import ServerTelemetry

log = logging.getLogger("toolmesh.mcp")

# The token of the request being served: the clients' token callbacks read it.
caller_token: contextvars.ContextVar[str | None] = contextvars.ContextVar("caller_token", default=None)

# How long the watch of a session's tools waits before it opens again after failing.
REWATCH_S = 1.0
# How long a cancelled MCP call waits for CancelInvocation.
CANCEL_TIMEOUT_S = 5.0
# How long a watch that no MCP session or listen stream holds lives after the session's last request.
WATCH_IDLE_S = 60.0
# The most sessions watched at once: each is a WatchTools stream to the registry.
MAX_WATCHES = 1000


def current_token() -> str:
    """The token of the request being served (the clients ask this before each call)."""
    return caller_token.get() or ""


SessionOf = Callable[[ServerRequestContext[Any, Any]], str]


@dataclass(eq=False)
class _Watched:
    """One session's tools as the gateway watches them, and who is told when they change."""

    bus: InMemorySubscriptionBus = field(default_factory=InMemorySubscriptionBus)
    # Handshake-era connections that read this session's tools, until each closes.
    connections: set[Connection] = field(default_factory=set)
    # Open subscriptions/listen requests.
    listening: int = 0
    task: asyncio.Task[None] | None = None
    # Ends a watch nothing holds once idle (set while nothing holds it).
    expiry: asyncio.TimerHandle | None = None

    @property
    def held(self) -> bool:
        """Whether an open MCP session or listen stream still needs this watch."""
        return bool(self.connections) or self.listening > 0

    def __post_init__(self) -> None:
        self.listen = ListenHandler(self.bus)


class Gateway:
    """Serves sessions' tools to MCP clients; `server` is the MCP SDK's low-level server to run.

    `session_of` says which session a request is for (the command line's for
    stdio, the URL's for HTTP); `token_of` reads the caller's token from the
    request (None: the clients' own token applies, as over stdio).
    """

    def __init__(
        self,
        registry: RegistryClient,
        invocation: InvocationClient,
        session_of: SessionOf,
        token_of: Callable[[ServerRequestContext[Any, Any]], str | None] | None = None,
        *,
        watch_idle_s: float = WATCH_IDLE_S,
        max_watches: int = MAX_WATCHES,
    ) -> None:
        self._registry = registry
        self.invocation = invocation
        self._session_of = session_of
        self._token_of = token_of
        self._watched: dict[str, _Watched] = {}
        self._watch_idle_s = watch_idle_s
        self._max_watches = max_watches
        # Each handshake-era connection serves one session: the first it named.
        self._bound: weakref.WeakKeyDictionary[Connection, str] = weakref.WeakKeyDictionary()
        self.tasks = TaskMiddleware(self)
        self.server: Server[Any] = _GatewayServer(
            "toolmesh",
            version=_version(),
            instructions="The tools of one toolmesh session. An exact retry of a call never runs it twice.",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_subscriptions_listen=self._listen,
            # Without it, the SDK lists the tools (a registry call) before each 2026-07-28 HTTP call, to
            # check Mcp-Param-* headers against the tool's schema. The invocation service checks the
            # arguments themselves against the schema, so the gateway checks no headers.
            get_tool_input_schema=_no_header_schema,
        )
        # Inside the SDK's OpenTelemetry middleware (the first): its span is current while timed.
        self.server.middleware.append(ServerTelemetry())
        self.server.middleware.append(self.tasks)
        self.server.extensions.update(extensions())

    async def close(self) -> None:
        """Stop watching the sessions' tools, and waiting for the calls of tasks."""
        await self.tasks.close()
        tasks = [w.task for w in self._watched.values() if w.task is not None]
        for session_id, watched in list(self._watched.items()):
            self._end_watch(session_id, watched)
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def watched_sessions(self) -> frozenset[str]:
        """The sessions whose tools are watched now (one WatchTools stream each)."""
        return frozenset(self._watched)

    def hearing(self, session_id: str) -> int:
        """How many MCP sessions hear the session's list_changed now."""
        watched = self._watched.get(session_id)
        return 0 if watched is None else len(watched.connections)

    # -- requests ---------------------------------------------------------
    def enter(self, ctx: ServerRequestContext[Any, Any]) -> str:
        """The request's session, its caller's token set for the clients; no state is kept yet.

        Nothing is watched or remembered for a request before a service has
        accepted its token (`hold`): an unauthenticated client pins no watch and
        joins no session's list_changed.
        """
        session_id = self._session_of(ctx)
        if self._token_of is not None:
            caller_token.set(self._token_of(ctx))
        # The session a connection serves is fixed by its first accepted request.
        connection = _connection_of(ctx)
        if connection is not None:
            bound = self._bound.get(connection)
            if bound is not None and bound != session_id:
                raise MCPError(types.INVALID_REQUEST, "This MCP session serves another toolmesh session.")
        return session_id

    def accepted(self, ctx: ServerRequestContext[Any, Any], session_id: str) -> bool:
        """Whether this request's connection was already accepted for the session (its token checked)."""
        connection = _connection_of(ctx)
        return connection is not None and self._bound.get(connection) == session_id

    async def authorize(self, ctx: ServerRequestContext[Any, Any], session_id: str) -> None:
        """Have the registry check the caller's token for the session, unless its connection was accepted."""
        if self.accepted(ctx, session_id):
            return
        try:
            await self._registry.list_tools(session_id)
        except grpc.aio.AioRpcError as error:
            raise refused(error) from None

    async def hold_connection(self, ctx: ServerRequestContext[Any, Any], session_id: str) -> None:
        """For a call on an MCP session: the session's watch, once the caller's token is accepted.

        A 2026-07-28 call (no connection) needs no watch: listen streams start their own.
        """
        if _connection_of(ctx) is not None:
            await self.authorize(ctx, session_id)
            self.hold(ctx, session_id)

    def hold(self, ctx: ServerRequestContext[Any, Any], session_id: str) -> _Watched:
        """The session's watch, started or kept, for a request whose token a service accepted.

        Raises OVERLOADED (MCPError) when `max_watches` are held.
        """
        connection = _connection_of(ctx)
        watched = self._watched.get(session_id)
        if watched is None:
            watched = self._watched[session_id] = self._new_watch()
        if connection is not None:
            self._bound.setdefault(connection, session_id)
            if connection not in watched.connections:
                watched.connections.add(connection)
                # Closed when the MCP session ends: DELETE, the transport's idle timeout, stdio closed.
                connection.exit_stack.callback(self._let_go, session_id, watched, connection)
        self._restart_idle_clock(session_id, watched)
        if watched.task is None or watched.task.done():
            # Started in this request's context: it watches with this caller's token.
            watched.task = asyncio.create_task(self._watch(session_id, watched))
        return watched

    def _new_watch(self) -> _Watched:
        """A new watch, within `max_watches`: the watches nothing holds end first; else OVERLOADED."""
        if len(self._watched) >= self._max_watches:
            for session_id, watched in list(self._watched.items()):
                if not watched.held:
                    self._end_watch(session_id, watched)
        if len(self._watched) >= self._max_watches:
            log.warning("too many sessions watched", extra={"max_watches": self._max_watches})
            raise refusal(Code.OVERLOADED)
        return _Watched()

    def _let_go(self, session_id: str, watched: _Watched, connection: Connection) -> None:
        """A connection closed: the watch ends when nothing else holds it."""
        watched.connections.discard(connection)
        if not watched.held:
            self._end_watch(session_id, watched)

    def _restart_idle_clock(self, session_id: str, watched: _Watched) -> None:
        """Restart the idle clock of a watch nothing holds; a held watch has none."""
        if watched.expiry is not None:
            watched.expiry.cancel()
            watched.expiry = None
        if not watched.held:
            loop = asyncio.get_running_loop()
            watched.expiry = loop.call_later(self._watch_idle_s, self._expire, session_id, watched)

    def _expire(self, session_id: str, watched: _Watched) -> None:
        watched.expiry = None
        if not watched.held:
            self._end_watch(session_id, watched)

    def _end_watch(self, session_id: str, watched: _Watched) -> None:
        """Stop watching the session's tools and forget it (the next request starts another watch)."""
        if self._watched.get(session_id) is watched:
            del self._watched[session_id]
        if watched.expiry is not None:
            watched.expiry.cancel()
            watched.expiry = None
        watched.listen.close()
        if watched.task is not None:
            watched.task.cancel()

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        session_id = self.enter(ctx)
        try:
            tool_set = await self._registry.list_tools(session_id)
        except grpc.aio.AioRpcError as error:
            raise refused(error) from None
        self.hold(ctx, session_id)
        return types.ListToolsResult(tools=[mcp_tool(spec) for spec in tool_set.tools])

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        session_id = self.enter(ctx)
        await self.hold_connection(ctx, session_id)
        named: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def announce(tool_request_id: str) -> None:
            if not named.done():
                named.set_result(tool_request_id)

        async def progressed(progress: ToolProgress) -> None:
            await ctx.session.report_progress(progress.progress, progress.total, progress.message)

        meta = params.meta or {}
        # A task of its own, so that the request's cancellation does not end the call before
        # its id is known: the id may arrive after the handler has started.
        call = asyncio.ensure_future(
            self.invoke(
                session_id,
                params,
                on_started=announce,
                # Progress only to a client that asked for it (a progressToken).
                on_progress=progressed if meta.get("progress_token") is not None else None,
            )
        )
        try:
            result = await asyncio.shield(call)
        except BaseException:
            # notifications/cancelled, or the client went away: the invocation stops, unless
            # another caller joined it (the service decides).
            with anyio.move_on_after(CANCEL_TIMEOUT_S, shield=True):
                await self._cancel_when_named(call, named)
            call.cancel()
            raise
        return call_tool_result(result)

    async def _cancel_when_named(self, call: asyncio.Future[CallResult], named: asyncio.Future[str]) -> None:
        """Cancel the call's invocation once the service named it, unless the call ended first."""
        either: set[asyncio.Future[Any]] = {named, call}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if named.done() and not call.done():
            await self._cancel(named.result())

    async def invoke(
        self,
        session_id: str,
        params: types.CallToolRequestParams,
        *,
        on_started: Callable[[str], object],
        on_progress: Callable[[ToolProgress], Awaitable[None]] | None = None,
    ) -> CallResult:
        """The tools/call as an invocation; a refused request raises MCPError."""
        key = (params.meta or {}).get(META_IDEMPOTENCY_KEY, "")
        if not isinstance(key, str):
            raise MCPError(types.INVALID_PARAMS, f"_meta {META_IDEMPOTENCY_KEY} must be a string.")
        try:
            result = await self.invocation.invoke(
                session_id,
                params.name,
                params.arguments or {},
                turn_id=f"mcp_{uuid.uuid4().hex[:16]}",
                idempotency_key=key,
                # No MCP message says a result arrived: outcomes replay to exact retries.
                confirm_delivery=False,
                on_started=on_started,
                on_progress=on_progress,
            )
        except grpc.aio.AioRpcError as error:
            raise refused(error) from None
        # DEBUG: a log line per call costs more than the call's own work (INFO is for what changes).
        log.debug(
            "mcp tool call",
            extra={
                "session_id": session_id,
                "tool_name": params.name,
                "tool_request_id": result.tool_request_id or "",
                "joined": result.joined,
                "replayed": result.replayed,
            },
        )
        return result

    async def _cancel(self, tool_request_id: str) -> None:
        """Cancel the invocation, shielded from the cancellation that asked for it; failures logged."""
        with anyio.move_on_after(CANCEL_TIMEOUT_S, shield=True):
            try:
                cancelled = await self.invocation.cancel_invocation(tool_request_id)
            except grpc.aio.AioRpcError as error:
                code = error_code(error)
                log.warning(
                    "cancelling an invocation failed",
                    extra={
                        "tool_request_id": tool_request_id,
                        "code": code.value if code else error.code().name,
                    },
                )
                return
            log.info("mcp call cancelled", extra={"tool_request_id": tool_request_id, "cancelled": cancelled})

    async def _listen(
        self, ctx: ServerRequestContext[Any, Any], params: types.SubscriptionsListenRequestParams
    ) -> types.SubscriptionsListenResult:
        session_id = self.enter(ctx)
        await self.authorize(ctx, session_id)
        watched = self.hold(ctx, session_id)
        watched.listening += 1
        self._restart_idle_clock(session_id, watched)
        try:
            return await watched.listen(ctx, params)
        finally:
            watched.listening -= 1
            if not watched.held and self._watched.get(session_id) is watched:
                self._restart_idle_clock(session_id, watched)

    # -- list_changed -----------------------------------------------------
    async def _watch(self, session_id: str, watched: _Watched) -> None:
        """Tell the session's clients each time its revision moves, until closed.

        A watch refused for its request (the token that started it, a bad session
        id) ends: the session's next request starts another, with its own token.
        """
        revision: int | None = None
        while True:
            try:
                async for tool_set in self._registry.watch_tools(session_id):
                    if revision is not None and tool_set.revision != revision:
                        await self._announce(watched)
                    revision = tool_set.revision
            except grpc.aio.AioRpcError as error:
                code = error_code(error)
                log.warning(
                    "watching tools failed",
                    extra={"session_id": session_id, "code": code.value if code else error.code().name},
                )
                if code is not None and ERROR_TABLE[code].caller_fault:
                    return
            await asyncio.sleep(REWATCH_S)

    async def _announce(self, watched: _Watched) -> None:
        await watched.bus.publish(ToolsListChanged())
        for connection in list(watched.connections):
            with contextlib.suppress(Exception):  # a connection that went away hears nothing
                await connection.send_tool_list_changed()


def _connection_of(ctx: ServerRequestContext[Any, Any]) -> Connection | None:
    """The handshake-era connection (MCP session) a request came on; None for 2026-07-28 requests."""
    connection: Connection | None = getattr(ctx.session, "_connection", None)
    if connection is None or ctx.protocol_version not in HANDSHAKE_PROTOCOL_VERSIONS:
        return None
    return connection


def _no_header_schema(tool_name: str) -> None:
    """No schema for Mcp-Param-* header checks (see Gateway)."""
    return None


class _GatewayServer(Server[Any]):
    """The SDK's low-level server, announcing tools/list_changed and tasks on every transport."""

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        options = super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True),
            experimental_capabilities,
            extensions,
        )
        options.capabilities.tasks = capabilities()
        return options


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("toolmesh")
    except PackageNotFoundError:
        return ""
