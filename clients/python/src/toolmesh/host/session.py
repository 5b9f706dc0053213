"""ToolHost: one handler host connected to the bridge for one session."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.trace import SpanKind

from toolmesh.core import correlation, telemetry
from toolmesh.core.backoff import Backoff
from toolmesh.core.bearer import Bearer, TokenSource, renew_in
from toolmesh.core.channels import open_channel
from toolmesh.core.errors import ERROR_TABLE, RETRYABLE_STATUSES, Code, ToolmeshError, code_for_reason
from toolmesh.core.exceptions import exception_fields
from toolmesh.core.limits import READ_CHECK_TIMEOUT_MS
from toolmesh.core.outcome import Outcome
from toolmesh.core.progress import capped_message
from toolmesh.core.rpcstatus import error_code, error_info, status_of, token_expired
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh.core.wire import outcome_to_pb, tool_to_pb
from toolmesh.host.context import ProgressReporter, ToolContext
from toolmesh.host.results import convert_return
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc

log = logging.getLogger("toolmesh.host")
# A progress report the bridge has not answered by then is given up (progress is best effort).
PROGRESS_TIMEOUT_S = 5.0


class _Sent:
    """An awaitable already done: a report a worker thread handed to the loop."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        yield from ()


_SENT = _Sent()

Handler = Callable[[dict[str, Any], ToolContext], Any]


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


class _Silence:
    """Notices a bridge that stopped talking: no event (not even a heartbeat) for `limit_s`.

    One watchdog per stream, not a timeout around each read (a task per event).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit_s: float) -> None:
        self._loop = loop
        self.limit_s = limit_s
        self._last = loop.time()
        self.expired = False

    def heard(self) -> None:
        self._last = self._loop.time()

    async def watch(self, call: Any) -> None:
        while True:
            # Re-read each time: the limit shrinks once the bridge says how often it beats.
            await asyncio.sleep(min(self.limit_s / 3, 1.0))
            if self._loop.time() - self._last > self.limit_s:
                self.expired = True
                call.cancel()
                return


@dataclass(frozen=True, slots=True)
class _Registered:
    handler: Handler
    # Decided once: an async handler runs on the loop, a plain one in a worker thread.
    is_async: bool

    @classmethod
    def of(cls, handler: Handler) -> _Registered:
        return cls(handler, inspect.iscoroutinefunction(handler))


@dataclass(slots=True)
class _ActiveCall:
    task: asyncio.Task[None]
    ctx: ToolContext
    cancellable: bool
    # Set once the handler has produced its outcome: from then on the runtime's
    # cancellation no longer reaches the task, so the outcome is submitted (and
    # a refusal reported), never dropped.
    submitting: bool = False


# Results in flight to the bridge at once; the rest wait their turn here, not in gRPC.
MAX_CONCURRENT_SUBMITS = 256
SUBMIT_GRACE_S = 5.0
# How long stop() lets results already on their way to the bridge arrive.
STOP_GRACE_S = 2.0
# Missing this many heartbeats in a row means the bridge is gone.
_MISSED_HEARTBEATS = 3
# The bridge refused the host itself: its token, or the address it was given.
_REFUSALS = frozenset({Code.UNAUTHENTICATED, Code.PERMISSION_DENIED, Code.WRONG_LISTENER})
DECLARE_TIMEOUT_S = 10.0
READ_CHECK_TIMEOUT_S = READ_CHECK_TIMEOUT_MS / 1000


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
    ) -> None:
        self.session_id = session_id
        self.bridge_target = bridge_target
        self.host_name = host_name or f"{socket.gethostname()}:python"
        # Why the last attempt to open the stream failed, for BridgeUnreachable.
        self._last_failure = ""
        self._closed = False
        self._own_channel = channel is None
        targets = [target.strip() for target in bridge_target.split(",") if target.strip()]
        self._channels = [channel] if channel is not None else [open_channel(t, credentials) for t in targets]
        # The replica connected to (or tried) now; the next one after a broken stream.
        self._turn = 0
        self._stub = bridge_pb2_grpc.BridgeServiceStub(self._channels[0])
        self._bearer = Bearer(token)
        # Set while the bridge refuses the host (`_refusal` says why); cleared once it takes it.
        self._refused_now = asyncio.Event()
        self._refusal: HostError | None = None
        self._handlers: dict[str, _Registered] = {}
        self._declared: dict[str, ToolSpec] = {}
        # Set once a host session is open and its tools were declared (or there were none).
        self._ready = asyncio.Event()
        self._generic: _Registered | None = None
        self._error_callbacks: list[ErrorCallback] = []
        self._active: dict[str, _ActiveCall] = {}
        self._connected = asyncio.Event()
        self._stopping = False
        self._stop_requested = asyncio.Event()
        self._submit_slots = asyncio.Semaphore(MAX_CONCURRENT_SUBMITS)
        self._answering: set[asyncio.Task[None]] = set()
        self._call: grpc.aio.UnaryStreamCall[Any, Any] | None = None
        # Streams a renewed one took over from, read until the bridge ends them (their calls answered).
        self._retiring: set[asyncio.Task[None]] = set()
        # The host sessions whose streams are open: a result goes to the one its request came on.
        self._open_sessions: set[str] = set()
        self._runner: asyncio.Task[None] | None = None
        self.host_session_id = ""

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
        self._handlers[name] = _Registered.of(handler)
        if description is not None:
            self._declared[name] = ToolSpec(
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
        self._declared = {spec.name: spec for spec in tools}
        if self.connected and self.host_session_id:
            await self._declare(self.host_session_id)

    def on_any(self, handler: Handler) -> None:
        """Serve every tool without a named handler; `ctx.tool_name` says which.

        The bridge prefers hosts with a named handler for a tool. Without either,
        a call gets TOOL_HANDLER_NOT_FOUND. The handler behaves as in `on_tool`.
        """
        self._generic = _Registered.of(handler)

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

    # -- lifecycle --------------------------------------------------------
    @property
    def connected(self) -> bool:
        """Whether the stream to the bridge is open now (the bridge said it opened the session)."""
        return self._connected.is_set()

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until the stream to the bridge is open.

        Raises:
            TimeoutError: not connected after `timeout` seconds.
            ToolmeshError: the bridge refused the host first (UNAUTHENTICATED,
                PERMISSION_DENIED, WRONG_LISTENER); it keeps trying meanwhile.
        """
        await self._until(self._connected, timeout)

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
            await self._until(self._ready, timeout)
        except TimeoutError:
            raise BridgeUnreachable(self.bridge_target, timeout, self._last_failure) from None

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
            await self._stop_requested.wait()
        finally:
            await self.stop()

    async def _until(self, event: asyncio.Event, timeout: float | None) -> None:
        """Wait for `event`, or raise ToolmeshError as soon as the bridge refuses the host."""
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._refused_now.wait())]
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # arrives as the wait ends, and `serve()` would never stop.
            async with asyncio.timeout(timeout):
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        refusal = self._refusal
        if not event.is_set() and refusal is not None:
            raise ToolmeshError(refusal.code, refusal.message)

    async def run(self) -> None:
        """Serve until `stop()`: open the stream, and open it again whenever it ends or falls silent.

        Reconnects after a jittered backoff (0.1 s doubling up to 1 s, so that a
        bridge that comes back is reached within about a second). A stream
        counts as silent when the bridge sends nothing for three heartbeat
        intervals. Failures are logged, never raised. `start()` runs this in a task.
        """
        backoff = Backoff()
        while not self._stopping:
            try:
                await self._serve_once()
                backoff.reset()
            except grpc.aio.AioRpcError as error:
                self._last_failure = f"{error.code().name}: {error.details()}"
                if self._connected.is_set() and token_expired(error):
                    # The stream outlived its token (one without `exp` is not renewed ahead): reopen soon.
                    log.info("host stream's token expired; reopening", extra={"session_id": self.session_id})
                    backoff.reset()
                else:
                    log.warning(
                        "host stream ended",
                        extra={"session_id": self.session_id, "grpc_status": error.code().name},
                    )
                    self._refused(error)
            except TimeoutError:
                log.warning("bridge heartbeats stopped; reconnecting", extra={"session_id": self.session_id})
            finally:
                self._connected.clear()
                self._ready.clear()
                self._call = None
            if self._stopping:
                break
            self._turn = (self._turn + 1) % len(self._channels)
            self._stub = bridge_pb2_grpc.BridgeServiceStub(self._channels[self._turn])
            # Waiting to reconnect, but not past stop(): it would wait as long.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_requested.wait(), backoff.next())

    def _refused(self, error: grpc.aio.AioRpcError) -> None:
        code = error_code(error)
        if code not in _REFUSALS:
            return
        assert code is not None
        first = self._refusal is None
        # The details start with the table's message; keep what the bridge added.
        detail = (error.details() or "").removeprefix(ERROR_TABLE[code].message).strip()
        self._refusal = HostError(code, detail, self.session_id)
        self._refused_now.set()
        if first:  # once until the next connection: a host that keeps trying does not flood on_error
            self._report(self._refusal)

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
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self._stop_requested.set()
        if self._call is not None:
            self._call.cancel()
        for retiring in list(self._retiring):
            retiring.cancel()
        if self._runner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        calls = list(self._active.values())
        for call in calls:
            if not call.submitting:
                call.task.cancel()
        tasks = [call.task for call in calls]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for answering in list(self._answering):
            answering.cancel()
        if self._own_channel:
            for channel in self._channels:
                await channel.close()

    async def __aenter__(self) -> ToolHost:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- the stream -------------------------------------------------------
    async def _serve_once(self) -> None:
        """One connection: a stream, renewed ahead of its token's expiry, until it ends or fails.

        A renewal opens a new stream that replaces the current one
        (replaces_host_session_id): the bridge sends the old one no new requests
        and ends it once it answered those it holds, so no call is lost to it.
        """
        replaces = ""
        while True:
            token = await self._bearer.token()
            call = self._stub.OpenHostSession(
                bridge_pb2.OpenHostSessionRequest(
                    session_id=self.session_id,
                    host_name=self.host_name,
                    handler_names=sorted(self._handlers),
                    has_generic_handler=self._generic is not None,
                    replaces_host_session_id=replaces,
                ),
                metadata=Bearer.with_token(token),
            )
            self._call = call
            reading = asyncio.create_task(self._read_stream(call))
            renewal = renew_in(token)
            if renewal is None:
                await reading
                return
            done, _ = await asyncio.wait({reading}, timeout=renewal)
            if done:
                return reading.result()
            if not self._connected.is_set():
                await reading  # never opened: nothing to take over from
                return
            # Keep reading the old stream for the requests it holds, until the bridge ends it.
            replaces = self.host_session_id
            self._retiring.add(reading)
            reading.add_done_callback(self._retired)

    def _retired(self, reading: asyncio.Task[None]) -> None:
        self._retiring.discard(reading)
        if not reading.cancelled() and reading.exception() is not None:
            log.debug("a replaced host stream ended", extra={"session_id": self.session_id})

    async def _read_stream(self, call: Any) -> None:
        # Until the bridge says how often it beats, allow a generous first wait.
        silence = _Silence(asyncio.get_running_loop(), limit_s=30.0)
        watchdog = asyncio.create_task(silence.watch(call))
        try:
            await self._read_events(call, silence)
        except asyncio.CancelledError:
            if silence.expired:
                raise TimeoutError from None
            call.cancel()
            raise
        finally:
            watchdog.cancel()

    async def _read_events(self, call: Any, silence: _Silence) -> None:
        # This stream's host session: its requests' results go there, even once a renewal took over.
        host_session_id = ""
        try:
            while True:
                event = await call.read()
                silence.heard()
                if event is grpc.aio.EOF:
                    return
                if event.WhichOneof("event") == "opened":
                    host_session_id = event.opened.host_session_id
                    self._open_sessions.add(host_session_id)
                self._on_event(event, host_session_id, silence)
        finally:
            self._open_sessions.discard(host_session_id)

    def _on_event(self, event: Any, host_session_id: str, silence: _Silence) -> None:
        kind = event.WhichOneof("event")
        if kind == "opened":
            self.host_session_id = host_session_id
            silence.limit_s = _MISSED_HEARTBEATS * max(event.opened.heartbeat_interval_ms, 100) / 1000
            self._refusal = None
            self._refused_now.clear()
            self._connected.set()
            log.info(
                "host connected",
                extra={"session_id": self.session_id, "host_session_id": self.host_session_id},
            )
            if self._declared:
                declaring = asyncio.create_task(self._declare(self.host_session_id))
                declaring.add_done_callback(lambda _: self._ready.set())
            else:
                self._ready.set()
        elif kind == "tool_request":
            self._begin(event.tool_request, host_session_id)
        elif kind == "cancelled":
            self._cancel(event.cancelled)
        elif kind == "heartbeat" and event.heartbeat.read_check:
            self._answer_read_check(host_session_id, event.heartbeat.read_check)

    def _answer_read_check(self, host_session_id: str, read_check: int) -> None:
        """Tell the bridge this host reads its stream: it routes requests to hosts that do."""
        task = asyncio.create_task(self._send_read_check(host_session_id, read_check))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _send_read_check(self, host_session_id: str, read_check: int) -> None:
        request = bridge_pb2.AnswerReadCheckRequest(host_session_id=host_session_id, read_check=read_check)
        try:
            with telemetry.client_call("toolmesh.v1.BridgeService/AnswerReadCheck") as metadata:
                await self._stub.AnswerReadCheck(
                    request, timeout=READ_CHECK_TIMEOUT_S, metadata=await self._bearer.metadata(metadata)
                )
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as error:
            # The next check asks again; a bridge that takes us for gone ends the stream.
            status = error.code().name if isinstance(error, grpc.aio.AioRpcError) else "CLOSED"
            log.debug("answering a read check failed", extra={"grpc_status": status})

    async def _declare(self, host_session_id: str) -> None:
        """Send the declared tools; a refusal goes to the error callbacks.

        After REGISTRY_UNAVAILABLE the bridge keeps the declaration and puts it later.
        """
        request = bridge_pb2.DeclareHostToolsRequest(
            host_session_id=host_session_id, tools=[tool_to_pb(spec) for spec in self._declared.values()]
        )
        try:
            with telemetry.client_call("toolmesh.v1.BridgeService/DeclareHostTools") as metadata:
                await self._stub.DeclareHostTools(
                    request, timeout=DECLARE_TIMEOUT_S, metadata=await self._bearer.metadata(metadata)
                )
        except grpc.aio.AioRpcError as error:
            info = error_info(error)
            code = (code_for_reason(info.reason) if info is not None else None) or Code.TRANSPORT_FAILED
            log.warning("declaring tools failed", extra={"session_id": self.session_id, "code": code.value})
            self._report(HostError(code, error.details() or "", self.session_id))

    def _begin(self, request: bridge_pb2.ToolRequest, host_session_id: str) -> None:
        ctx = ToolContext(
            session_id=request.session_id,
            turn_id=request.turn_id,
            tool_request_id=request.tool_request_id,
            tool_name=request.tool_name,
            deadline=time.monotonic() + request.timeout_ms / 1000,
            reporter=self._progress_reporter(request.tool_request_id),
        )
        handler = self._handlers.get(ctx.tool_name) or self._generic
        task = asyncio.create_task(
            self._serve(handler, request.arguments_json, ctx, host_session_id, dict(request.trace_context))
        )
        # Async handlers are cancelled on the runtime's word; a sync handler's
        # thread cannot be, so it finishes and its late result is refused.
        self._active[ctx.tool_request_id] = _ActiveCall(task, ctx, handler is not None and handler.is_async)
        task.add_done_callback(lambda _: self._active.pop(ctx.tool_request_id, None))

    def _progress_reporter(self, tool_request_id: str) -> ProgressReporter:
        """What `ctx.report_progress` calls for the request.

        On the loop it gives the coroutine to await; from a sync handler's worker
        thread it sends the report from the loop and returns at once.
        """
        loop = asyncio.get_running_loop()

        def report(progress: float, total: float | None, message: str | None) -> Awaitable[None]:
            sending = self._report_progress(tool_request_id, progress, total, message)
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:  # no loop in this thread: a worker thread
                on_loop = False
            if on_loop:
                return sending
            asyncio.run_coroutine_threadsafe(sending, loop)
            return _SENT

        return report

    async def _report_progress(
        self, tool_request_id: str, progress: float, total: float | None, message: str | None
    ) -> None:
        """Send one progress report to the bridge; never raises, logs no values (best effort).

        The message is cut to its cap here already: what the bridge would drop is not sent.
        """
        try:
            request = bridge_pb2.ReportToolProgressRequest(
                host_session_id=self.host_session_id,
                tool_request_id=tool_request_id,
                progress=progress,
                message=capped_message(message)[0],
            )
            if total is not None:
                request.total = total
            with telemetry.client_call("toolmesh.v1.BridgeService/ReportToolProgress") as metadata:
                response = await self._stub.ReportToolProgress(
                    request, timeout=PROGRESS_TIMEOUT_S, metadata=await self._bearer.metadata(metadata)
                )
        except Exception as error:
            # A number of the wrong type, a transport failure, a token callback that failed, a host
            # session gone: progress is optional, and the handler goes on.
            status = error.code().name if isinstance(error, grpc.aio.AioRpcError) else type(error).__name__
            log.debug(
                "a progress report was not sent", extra={"tool_request_id": tool_request_id, "cause": status}
            )
            return
        if response.status != bridge_pb2.PROGRESS_REPORT_STATUS_ACCEPTED:
            status_name = bridge_pb2.ProgressReportStatus.Name(response.status)
            log.debug(
                "a progress report was dropped",
                extra={"tool_request_id": tool_request_id, "cause": status_name},
            )

    def _cancel(self, cancelled: bridge_pb2.ToolRequestCancelled) -> None:
        active = self._active.get(cancelled.tool_request_id)
        if active is None:
            return
        reason = "timeout" if cancelled.reason == bridge_pb2.CANCEL_REASON_TIMEOUT else "cancelled"
        active.ctx.cancellation.set(reason)
        log.info("tool call cancelled", extra=_ids(active.ctx) | {"reason": reason})
        if active.cancellable and not active.submitting:
            active.task.cancel()

    async def _serve(
        self,
        handler: _Registered | None,
        arguments_json: str,
        ctx: ToolContext,
        host_session_id: str,
        trace_context: dict[str, str],
    ) -> None:
        # The invocation's trace continues here: the request carried its context.
        with (
            telemetry.span("toolmesh.host.handle", SpanKind.SERVER, trace_context) as span,
            correlation.ids(
                session_id=ctx.session_id,
                turn_id=ctx.turn_id,
                tool_request_id=ctx.tool_request_id,
                tool_name=ctx.tool_name,
            ),
        ):
            log.debug("handling tool request")
            outcome = await self._execute(handler, arguments_json, ctx)
            if outcome is None:
                span.set_attribute("toolmesh.cancelled", True)
                return
            active = self._active.get(ctx.tool_request_id)
            if active is not None:
                active.submitting = True
            telemetry.record_outcome(outcome)
            await self._submit(outcome, ctx, host_session_id)

    async def _execute(
        self, registered: _Registered | None, arguments_json: str, ctx: ToolContext
    ) -> Outcome | None:
        """Run the handler; None when it was cancelled and produced nothing."""
        if registered is None:
            log.warning("no handler for tool", extra=_ids(ctx))
            return Outcome.runtime_error(
                Code.TOOL_HANDLER_NOT_FOUND, f"No handler for {ctx.tool_name}.", {"tool": ctx.tool_name}
            )
        try:
            arguments = json.loads(arguments_json)
            handler = registered.handler
            if registered.is_async:
                value = await handler(arguments, ctx)
            else:
                value = await asyncio.to_thread(handler, arguments, ctx)
                if inspect.isawaitable(value):
                    value = await value
        except asyncio.CancelledError:
            if self._stopping:
                self._submit_failed(ctx, Code.SHUTTING_DOWN.value, "The host stopped while the handler ran.")
                return None
            if ctx.cancelled:  # the runtime said stop: the caller has its outcome, nothing was produced
                return None
            raise
        except Exception as exc:
            # The full exception stays in the host's own log; the caller gets a compact error.
            # The exception's text may quote the arguments: its type and frame only.
            log.error(
                "tool handler raised",
                extra=_ids(ctx) | {"code": Code.TOOL_HANDLER_ERROR.value} | exception_fields(exc),
            )
            self._report(HostError(Code.TOOL_HANDLER_ERROR, type(exc).__name__, **_ids(ctx)))
            return Outcome.runtime_error(
                Code.TOOL_HANDLER_ERROR, "", {"tool": ctx.tool_name, "exception": type(exc).__name__}
            )
        converted = convert_return(value)
        if converted.refused_because is not None:
            self._report(
                HostError(
                    Code.SUBMIT_TOOL_RESULT_FAILED,
                    converted.outcome.failure.message if converted.outcome.failure else "",
                    cause=converted.refused_because.value,
                    **_ids(ctx),
                )
            )
        return converted.outcome

    async def _submit(self, outcome: Outcome, ctx: ToolContext, host_session_id: str) -> None:
        """Hand the outcome to the bridge, retrying transport failures until the call's deadline.

        Ends with the outcome delivered or a SUBMIT_TOOL_RESULT_FAILED report,
        whatever happens meanwhile: a refusal, a transport that stays down, this
        host stopping. When the stream broke meanwhile (its bridge replica may be
        gone), it waits for the next connection and hands the outcome in there,
        naming the same request. Sending the same outcome again is safe: the
        bridge accepts one outcome per request and says whether it was this one
        (REQUEST_ENDED, ended=answered).
        """
        try:
            cause, detail = await self._deliver(outcome, ctx, host_session_id)
        except asyncio.CancelledError:
            # Only stop() cancels a submit: the result goes nowhere, so say so.
            self._submit_failed(ctx, Code.SHUTTING_DOWN.value, "The host stopped before the bridge answered.")
            raise
        except Exception as exc:
            log.error(
                "submit raised", extra=_ids(ctx) | {"code": Code.INTERNAL.value} | exception_fields(exc)
            )
            self._submit_failed(ctx, Code.INTERNAL.value, type(exc).__name__)
            return
        if cause is not None:
            self._submit_failed(ctx, cause, detail)

    async def _deliver(
        self, outcome: Outcome, ctx: ToolContext, host_session_id: str
    ) -> tuple[str | None, str]:
        """Send until the bridge takes the outcome (None) or says why not (the cause and its message)."""
        request = bridge_pb2.SubmitToolResultRequest(
            host_session_id=host_session_id,
            tool_request_id=ctx.tool_request_id,
            outcome=outcome_to_pb(outcome),
        )
        attempt = 0
        while True:
            attempt += 1
            if request.host_session_id not in self._open_sessions:
                # Its stream broke: hand the result in on the next connection, naming the same request.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._connected.wait(), max(ctx.time_remaining(), 0.0))
                request.host_session_id = self.host_session_id
            try:
                async with self._submit_slots:
                    with telemetry.client_call("toolmesh.v1.BridgeService/SubmitToolResult") as metadata:
                        await self._stub.SubmitToolResult(
                            request,
                            timeout=max(ctx.time_remaining(), 1.0) + SUBMIT_GRACE_S,
                            metadata=await self._bearer.metadata(metadata),
                        )
                return None, ""
            except grpc.aio.UsageError:
                return Code.TRANSPORT_FAILED.value, "The channel to the bridge is closed."
            except grpc.aio.AioRpcError as error:
                info = error_info(error)
                reason = code_for_reason(info.reason) if info is not None else None
                if (
                    attempt > 1
                    and reason is Code.REQUEST_ENDED
                    and info
                    and info.metadata.get("ended") == "answered"
                ):
                    return None, ""  # an earlier attempt got through; its answer was lost on the way back
                # No code of ours: the transport's own failure, retried while the table says it may pass.
                transient = reason is None and status_of(error.code()) in RETRYABLE_STATUSES
                retry = transient and ctx.time_remaining() > 0
                if retry and not self._stopping:
                    await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
                    continue
                cause = reason.value if reason is not None else Code.TRANSPORT_FAILED.value
                log.warning(
                    "submit failed", extra=_ids(ctx) | {"cause": cause, "grpc_status": error.code().name}
                )
                return cause, error.details() or ""

    def _submit_failed(self, ctx: ToolContext, cause: str, detail: str) -> None:
        self._report(HostError(Code.SUBMIT_TOOL_RESULT_FAILED, detail, cause=cause, **_ids(ctx)))

    def _report(self, error: HostError) -> None:
        for callback in self._error_callbacks:
            try:
                callback(error)
            except Exception as exc:
                log.error(
                    "on_error callback raised", extra={"code": error.code.value} | exception_fields(exc)
                )


def _ids(ctx: ToolContext) -> dict[str, str]:
    return {
        "session_id": ctx.session_id,
        "turn_id": ctx.turn_id,
        "tool_request_id": ctx.tool_request_id,
        "tool_name": ctx.tool_name,
    }
