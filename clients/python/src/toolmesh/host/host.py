"""ToolHost: one handler host serving one session's tools over the bridge; the SDK's public face.

Registration and the host's lifecycle live here; the stream, the calls and their
submits are the engine's (toolmesh.host.engine).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from toolmesh.core.bearer import TokenSource
from toolmesh.core.errors import Code
from toolmesh.core.exceptions import exception_fields
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh.host.engine import ActiveCall, Handler, HostEngine, Registered, Registrations

log = logging.getLogger("toolmesh.host")


@dataclass(frozen=True, slots=True)
class HostError:
    """What went wrong on the host side of one call, as `on_error` callbacks receive it.

    `code` is TOOL_HANDLER_ERROR (a handler raised; `message` is the exception's
    type) or SUBMIT_TOOL_RESULT_FAILED (the result could not be handed to the
    bridge; `cause` says why). Carries ids only: never arguments, results or
    exception text.
    """

    code: Code
    message: str
    session_id: str
    turn_id: str = ""
    tool_request_id: str = ""
    tool_name: str = ""
    # For SUBMIT_TOOL_RESULT_FAILED: the bridge's reason (REQUEST_ENDED, ...),
    # TRANSPORT_FAILED / RESULT_NOT_JSON / RESULT_TOO_LARGE, or SHUTTING_DOWN
    # (stop() came first), INTERNAL (the SDK itself failed; its log says how).
    cause: str = ""


ErrorCallback = Callable[[HostError], None]


class BridgeUnreachable(TimeoutError):
    """No connection to the bridge was made in time; the message names its address and the last failure."""

    def __init__(self, target: str, waited_s: float | None, last_failure: str) -> None:
        within = f" within {waited_s:g} s" if waited_s is not None else ""
        cause = f" (last failure: {last_failure})" if last_failure else ""
        super().__init__(
            f"Could not connect to the toolmesh bridge at {target}{within}{cause}. "
            "Is it running? `toolmesh up` (or ./scripts/up) starts it."
        )
        self.target = target


class ToolHost:
    """One handler host: serves one session's tools from application code, over the bridge.

    For applications that own tools. Register handlers with `on_tool` / `on_any`,
    then either `await host.serve()` (connects, then serves until `stop()` or
    until its task is cancelled, e.g. by Ctrl-C under `asyncio.run`), or
    `start()` / `async with host:` (connects and returns, serving in the
    background until `stop()` or the end of the block). The host keeps a
    stream to the bridge open, reconnecting when it drops, runs each tool
    request it receives and hands the outcome back. A handler's failures never
    reach the caller as exceptions: they become runtime errors of the call (see
    `on_tool`), and problems the caller cannot see are reported to `on_error`.

    Args:
        bridge_target: The bridge's address, `host:port`; or several replicas' addresses separated
            by commas: the host connects to one and, when its stream breaks, to the next. A result
            whose bridge replica was lost while the handler ran is handed in on the next connection.
        session_id: The session whose tools this host serves.
        host_name: How the bridge's logs name this host; default `<hostname>:python`.
        channel: A channel to use instead of opening one (the host then does not close it).
        credentials: TLS for a channel it opens (toolmesh.core.tls.client_credentials).
        token: A token naming the session with the role host: text, or a callback (sync or
            async) asked before each call, so that a long-lived host can refresh it.
        acknowledge_starts: Ask the bridge before starting each request (StartToolRequests, one
            call for the requests read together) and run only those it says START for: a request
            whose deadline passed by the bridge's clock never starts, and one this host never
            started when it goes away runs on another host instead of failing. False: run each
            request as it is read, as hosts did before (one round trip less per call; a request
            in flight when the host goes away then ends TOOL_HOST_DISCONNECTED unless read-only
            or idempotent).
    """

    def __init__(
        self,
        bridge_target: str,
        session_id: str,
        *,
        host_name: str | None = None,
        channel: grpc.aio.Channel | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        token: TokenSource | None = None,
        acknowledge_starts: bool = True,
    ) -> None:
        self.session_id = session_id
        self.bridge_target = bridge_target
        self.host_name = host_name or f"{socket.gethostname()}:python"
        self._tools = Registrations()
        self._error_callbacks: list[ErrorCallback] = []
        self._engine = HostEngine(
            bridge_target,
            session_id,
            host_name=self.host_name,
            channel=channel,
            credentials=credentials,
            token=token,
            tools=self._tools,
            report=self._report,
            acknowledge_starts=acknowledge_starts,
        )
        # The task `start()` runs `run()` in.
        self._runner: asyncio.Task[None] | None = None

    # -- registration -----------------------------------------------------
    def on_tool(
        self,
        name: str,
        handler: Handler,
        *,
        description: str | None = None,
        input_schema: dict[str, Any] | None = None,
        output_schema: dict[str, Any] | None = None,
        timeout_ms: int = 0,
        annotations: ToolAnnotations | None = None,
    ) -> None:
        """Serve the tool `name` with `handler(args, ctx)`. Register before `start()`.

        `args` is the call's JSON object, `ctx` its ToolContext. An async handler
        runs on the event loop and is cancelled when the runtime says stop; a sync
        one runs in a worker thread and should watch `ctx.cancellation`. The handler
        returns a JSON value (the result) or `{"error": {"code", "message",
        "details"?, "retryable"?}}` (a domain error). Anything it raises becomes
        TOOL_HANDLER_ERROR for the caller (only the exception's type is sent); a
        value that is not plain JSON or is larger than MAX_RESULT_BYTES becomes
        TOOL_RESULT_INVALID, and is reported to `on_error`.

        With a `description`, the tool is also declared: its definition goes into
        the session's list each time the host connects (DeclareHostTools), so no
        separate `tools put` is needed, and it comes back by itself when the
        registry restarts. `input_schema` defaults to `{"type": "object"}`. A
        declaration the bridge refuses (INVALID_SCHEMA, ...) is reported to `on_error`.
        """
        self._tools.handlers[name] = Registered.of(handler)
        if description is not None:
            self._tools.declared[name] = ToolSpec(
                name=name,
                description=description,
                input_schema_json=json.dumps(
                    input_schema if input_schema is not None else {"type": "object"}
                ),
                output_schema_json="" if output_schema is None else json.dumps(output_schema),
                timeout_ms=timeout_ms,
                annotations=annotations or ToolAnnotations(),
            )

    async def declare_tools(self, tools: Sequence[ToolSpec]) -> None:
        """Replace the tools this host declares with `tools`: sent now when connected, else on connecting.

        For hosts whose tools change while they serve (an MCP server's list, say);
        `on_tool(..., description=...)` declares a fixed tool. A tool declared
        before and left out now is withdrawn from the session's list. A refusal
        is reported to `on_error`, as for `on_tool`.
        """
        self._tools.declared = {spec.name: spec for spec in tools}
        if self.connected and self.host_session_id:
            await self._engine.declare(self.host_session_id)

    def on_any(self, handler: Handler) -> None:
        """Serve every tool without a named handler; `ctx.tool_name` says which.

        The bridge prefers hosts with a named handler for a tool. Without either,
        a call gets TOOL_HANDLER_NOT_FOUND. The handler behaves as in `on_tool`.
        """
        self._tools.generic = Registered.of(handler)

    def on_error(self, callback: ErrorCallback) -> None:
        """Call `callback(HostError)` for each failure the caller cannot see from here.

        That is a handler that raised, a result that could not be sent as it was,
        and a result the bridge refused or could not be reached for (after
        retrying transport failures until the call's deadline), or that `stop()`
        kept from arriving. Every handler run ends either with its result handed
        to the bridge or with such a report, whatever arrives when (a
        cancellation once the handler has finished does not stop its submit).
        A callback that raises is logged and does not stop the others.
        """
        self._error_callbacks.append(callback)

    def _report(self, code: Code, message: str, *, cause: str = "", **ids: str) -> None:
        """Hand a HostError to each `on_error` callback; one that raises is logged."""
        error = HostError(code, message, cause=cause, **ids)
        for callback in self._error_callbacks:
            try:
                callback(error)
            except Exception as exc:
                log.error(
                    "on_error callback raised", extra={"code": error.code.value} | exception_fields(exc)
                )

    # -- lifecycle --------------------------------------------------------
    @property
    def host_session_id(self) -> str:
        """The host session the bridge opened for the stream opened last; empty before the first."""
        return self._engine.host_session_id

    @property
    def connected(self) -> bool:
        """Whether the stream to the bridge is open now (the bridge said it opened the session)."""
        return self._engine.connected

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until the stream to the bridge is open.

        Raises:
            TimeoutError: not connected after `timeout` seconds.
            ToolmeshError: the bridge refused the host first (UNAUTHENTICATED,
                PERMISSION_DENIED, WRONG_LISTENER); it keeps trying meanwhile.
        """
        await self._engine.until_connected(timeout)

    async def start(self, timeout: float | None = 10.0) -> None:
        """Connect in the background, reconnecting whenever the stream drops; wait for the first connection.

        Returns once connected: the host then serves in the background until
        `stop()` (a script that only awaits `start()` ends, and serves nothing:
        use `serve()` there). Raises BridgeUnreachable (a TimeoutError naming
        the bridge's address) when no connection was made within `timeout`,
        and ToolmeshError when the bridge refused the host (its token does not
        name the session with the role host, or has expired); the host keeps
        trying until `stop()` (a token callback may give a better token).
        """
        self._runner = asyncio.create_task(self.run())
        try:
            await self._engine.until_ready(timeout)
        except TimeoutError:
            raise BridgeUnreachable(self.bridge_target, timeout, self._engine.last_failure) from None

    async def serve(self, timeout: float | None = 10.0) -> None:
        """Connect, then serve until `stop()` is called or this task is cancelled; stop cleanly either way.

        The call to make at the end of a host program: `asyncio.run(main())`
        with `await host.serve()` in `main` serves until Ctrl-C or SIGTERM
        handling calls `stop()`. Raises BridgeUnreachable (after stopping) when
        the first connection is not made within `timeout`, ToolmeshError when
        the bridge refused the host.
        """
        try:
            await self.start(timeout)
            await self._engine.until_stop_requested()
        finally:
            await self.stop()

    async def run(self) -> None:
        """Serve until `stop()`: open the stream, and open it again whenever it ends or falls silent.

        Reconnects after a jittered backoff (0.1 s doubling up to 1 s, so that a
        bridge that comes back is reached within about a second). A stream
        counts as silent when the bridge sends nothing for three heartbeat
        intervals. Failures are logged, never raised. `start()` runs this in a task.
        """
        await self._engine.run()

    async def stop(self) -> None:
        """Close the stream, cancel the handlers still running, finish submits, close an owned channel.

        Results being handed to the bridge get up to STOP_GRACE_S to arrive.
        Every call whose result does not reach the bridge (its handler was
        cancelled, or its submit did not finish in time) is reported to
        `on_error` as SUBMIT_TOOL_RESULT_FAILED with cause SHUTTING_DOWN. A sync
        handler's thread cannot be cancelled: it finishes, and its result is not
        sent. Returns without waiting out a reconnect backoff. Stopping twice is
        harmless.
        """
        await self._engine.stop(self._runner)

    async def __aenter__(self) -> ToolHost:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def _active(self) -> dict[str, ActiveCall]:
        """The calls whose handler or submit is still running, by tool request id."""
        return self._engine.active
