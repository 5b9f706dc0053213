"""The engine behind ToolHost: the stream to the bridge, the calls it brings, and their submits.

Private to toolmesh.host (ToolHost is its only user). Its life is one state
machine: `State` names where it is, `Trigger` what moved it, `_MOVES` every
move, and `HostEngine._on` is the one place the state changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from opentelemetry.trace import SpanKind

from toolmesh.core import correlation, telemetry
from toolmesh.core.backoff import Backoff
from toolmesh.core.bearer import Bearer, TokenSource, renew_in
from toolmesh.core.channels import open_channel
from toolmesh.core.errors import ERROR_TABLE, RETRYABLE_STATUSES, Code, ToolmeshError, code_for_reason
from toolmesh.core.exceptions import exception_fields
from toolmesh.core.limits import MAX_CALLS_PER_MESSAGE, READ_CHECK_TIMEOUT_MS
from toolmesh.core.outcome import Outcome
from toolmesh.core.progress import capped_message
from toolmesh.core.rpcstatus import error_code, error_info, status_of, token_expired
from toolmesh.core.tools import ToolSpec
from toolmesh.core.wire import outcome_to_pb, tool_to_pb
from toolmesh.host.context import ProgressReporter, ToolContext
from toolmesh.host.copies import COPY_AFTER_S, answered_before, hand_in_copies
from toolmesh.host.host_work import HostWorkLink
from toolmesh.host.replicas import any_answers, first_answering
from toolmesh.host.results import convert_return
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc

log = logging.getLogger("toolmesh.host")
# A progress report the bridge has not answered by then is given up (progress is best effort).
PROGRESS_TIMEOUT_S = 5.0
# Results in flight to the bridge at once; the rest wait their turn here, not in gRPC.
MAX_CONCURRENT_SUBMITS = 256
# A submit attempt waits for the bridge's answer until the call's deadline and this much past it
# (the network's delay, the clocks' offset), never longer: a bridge that does not answer by then
# (frozen, a broken link) has ended the call without this result anyway.
SUBMIT_GRACE_S = 1.0
# A result no bridge took by then is handed in for this long after the call's deadline: a bridge
# that shares the ledger keeps it beside the caller's TOOL_TIMEOUT (for GetInvocation and exact
# retries), so a bridge frozen or cut off past the deadline does not lose what the handler did.
LATE_SUBMIT_S = 60.0
# With several bridge addresses, one submit attempt waits for the bridge's answer a third of the
# time left for it (its deadline and SUBMIT_GRACE_S), within these bounds, never longer than that:
# the rest is for reconnecting elsewhere and handing the result in there.
# A bridge that answers nothing by then, not even a heartbeat on the stream, is taken for frozen:
# its stream is given up and the result goes to the next replica, in the time still left (a
# healthy bridge answers in milliseconds).
SUBMIT_ATTEMPT_MIN_S = 1.0
SUBMIT_ATTEMPT_MAX_S = 5.0
# A new host stream waits this long for the bridge's first event before it is given up (then
# reopened, on the next address if there are several); with several bridge addresses, the shorter
# one: a frozen replica (SIGSTOP, a stuck event loop) accepts the connection and says nothing, and
# would hold the host for the longer wait while another replica is up (a healthy one answers in
# milliseconds, a loaded one in a second or two).
FIRST_EVENT_S = 30.0
FIRST_EVENT_ELSEWHERE_S = 5.0
# A host leaves a silent bridge replica only for another that answers its health check this soon.
OTHERS_ANSWER_S = 1.0
# How long stop() lets results already on their way to the bridge arrive.
STOP_GRACE_S = 2.0
# Missing this many heartbeats in a row means the bridge is gone.
_MISSED_HEARTBEATS = 3
# The bridge refused the host itself: its token, or the address it was given.
_REFUSALS = frozenset({Code.UNAUTHENTICATED, Code.PERMISSION_DENIED, Code.WRONG_LISTENER})
DECLARE_TIMEOUT_S = 10.0
# The longest wait for the bridge's answer to StartToolRequests; no answer, no start.
START_TIMEOUT_S = 10.0
READ_CHECK_TIMEOUT_S = READ_CHECK_TIMEOUT_MS / 1000

Handler = Callable[[dict[str, Any], ToolContext], Any]


class State(enum.Enum):
    """Where the engine is in its life."""

    IDLE = "idle"
    """Created; `run()` has not begun."""
    CONNECTING = "connecting"
    """A stream is being opened; the bridge has not said it opened the host session."""
    SERVING = "serving"
    """A stream is open: tool requests arrive on it."""
    RENEWING = "renewing"
    """A new stream is opening ahead of the token's expiry, to replace the open one (which still answers)."""
    BACKING_OFF = "backing_off"
    """The stream ended, failed or fell silent; waiting before trying the next replica."""
    CLOSING = "closing"
    """`stop()` came while a stream was open; it is being cancelled (and counts as open until it ends)."""
    DRAINING = "draining"
    """`stop()` came and no stream is open: handlers are cancelled, submits get STOP_GRACE_S."""
    STOPPED = "stopped"
    """`stop()` finished; an owned channel is closed."""


class Trigger(enum.Enum):
    """What moves the engine from one state to another."""

    CONNECT = "connect"
    """The run loop opens a stream."""
    OPENED = "opened"
    """The bridge said a stream's host session is open."""
    RENEW = "renew"
    """The open stream's token is about to expire: a new stream replaces it."""
    ENDED = "ended"
    """The run loop's stream ended (however: EOF, an error, silence, a cancellation)."""
    STOP = "stop"
    """`stop()` was called."""
    DRAINED = "drained"
    """`stop()` has finished the calls and closed what it owns."""


# Every move; a trigger not listed for a state leaves it where it is.
_MOVES: dict[tuple[State, Trigger], State] = {
    (State.IDLE, Trigger.CONNECT): State.CONNECTING,
    (State.BACKING_OFF, Trigger.CONNECT): State.CONNECTING,
    (State.CONNECTING, Trigger.OPENED): State.SERVING,
    (State.RENEWING, Trigger.OPENED): State.SERVING,
    # A stream that opened although stop() came as it was being opened: it is closed with the rest.
    (State.DRAINING, Trigger.OPENED): State.CLOSING,
    (State.SERVING, Trigger.RENEW): State.RENEWING,
    # The replacing stream did not open before its own token's renewal time: replaced in turn.
    (State.RENEWING, Trigger.RENEW): State.RENEWING,
    (State.CONNECTING, Trigger.ENDED): State.BACKING_OFF,
    (State.SERVING, Trigger.ENDED): State.BACKING_OFF,
    (State.RENEWING, Trigger.ENDED): State.BACKING_OFF,
    (State.CLOSING, Trigger.ENDED): State.DRAINING,
    (State.IDLE, Trigger.STOP): State.DRAINING,
    (State.CONNECTING, Trigger.STOP): State.DRAINING,
    (State.BACKING_OFF, Trigger.STOP): State.DRAINING,
    (State.SERVING, Trigger.STOP): State.CLOSING,
    (State.RENEWING, Trigger.STOP): State.CLOSING,
    (State.CLOSING, Trigger.DRAINED): State.STOPPED,
    (State.DRAINING, Trigger.DRAINED): State.STOPPED,
}
# A stream is open (`connected`): requests may arrive, results go to its host session.
_OPEN = frozenset({State.SERVING, State.RENEWING, State.CLOSING})
# stop() was called.
_STOPPING = frozenset({State.CLOSING, State.DRAINING, State.STOPPED})


class Reporter(Protocol):
    """Hands a failure the caller cannot see to the host's `on_error` callbacks."""

    def __call__(self, code: Code, message: str, *, cause: str = "", **ids: str) -> None:
        """Report `code`; `ids` name the session (and turn, tool request, tool) it concerns."""


@dataclass(frozen=True, slots=True)
class Registered:
    """A handler as registered."""

    handler: Handler
    # Decided once: an async handler runs on the loop, a plain one in a worker thread.
    is_async: bool

    @classmethod
    def of(cls, handler: Handler) -> Registered:
        """Register `handler`."""
        return cls(handler, inspect.iscoroutinefunction(handler))


@dataclass(slots=True)
class Registrations:
    """What the host serves, written by ToolHost's registration and read by the engine as it serves."""

    handlers: dict[str, Registered] = field(default_factory=dict)
    generic: Registered | None = None
    # The tools declared to the session each time the host connects.
    declared: dict[str, ToolSpec] = field(default_factory=dict)


class _Sent:
    """An awaitable already done: a report a worker thread handed to the loop."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        yield from ()


_SENT = _Sent()


class _Silence:
    """Notices a bridge that stopped talking: no event (not even a heartbeat) for `limit_s`.

    One watchdog per stream, not a timeout around each read (a task per event). `declare()`
    gives the stream up at once, as the watchdog does (a submit that got no answer).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit_s: float, call: Any) -> None:
        self._loop = loop
        self._call = call
        self.limit_s = limit_s
        self._last = loop.time()
        # Events read so far: "heard since" counts them, as the loop's clock cannot tell an event
        # from a send of the same turn (uvloop's reads whole milliseconds, once per turn).
        self.events = 0
        self.expired = False

    def heard(self) -> None:
        self._last = self._loop.time()
        self.events += 1

    def heard_since(self, mark: int) -> bool:
        """Whether the stream brought anything since `mark` (the `events` count then)."""
        return self.events > mark

    def declare(self) -> None:
        self.expired = True
        self._call.cancel()

    async def watch(self) -> None:
        while True:
            # Re-read each time: the limit shrinks once the bridge says how often it beats.
            await asyncio.sleep(min(self.limit_s / 3, 1.0))
            if self._loop.time() - self._last > self.limit_s:
                self.declare()
                return


@dataclass(slots=True)
class _Link:
    """An open stream's host session as its submits see it.

    The channel's stub, the stream's silence, and the submits in flight to it, cut (cancelled)
    when the stream ends.
    """

    host_session_id: str
    stub: bridge_pb2_grpc.BridgeServiceAsyncStub
    silence: _Silence
    # Which of the bridge addresses it is on (the others take a copy of a result it leaves unanswered).
    turn: int
    submits: set[Any] = field(default_factory=set)
    # The stream ended, broke or was given up: its submits go to the next connection.
    cut: bool = False

    def end(self) -> None:
        """No more submits go here; those in flight are cut if the stream was given up as silent.

        They would wait on a frozen bridge. Otherwise they go on: one may be answered as the
        stream ends, and a broken connection fails them itself.
        """
        self.cut = True
        if self.silence.expired:
            for call in self.submits:
                call.cancel()


@dataclass(slots=True)
class _Stream:
    """One host stream's own facts.

    Its host session, whether its bridge acknowledges starts, and how far the bridge's clock is at
    most ahead of this process's `time.monotonic()`.
    """

    # time.monotonic() when this process asked for the stream.
    asked_at: float
    host_session_id: str = ""
    starts_acknowledged: bool = False
    # The least (bridge time + 1 - monotonic time when this process sent what the bridge answered)
    # seen, in ms: the bridge read its clock (rounded down) after that, so this is at least the
    # offset, and a delay on the way (a pause, a slow network) only raises a sample, which puts
    # deadlines earlier, never late. None until the bridge sends its clock.
    offset_ms: float | None = None

    def answered(self, server_time_unix_ms: int, sent_at: float) -> None:
        """Take the bridge's clock from its answer to what this process sent at `sent_at`."""
        if server_time_unix_ms:
            sample = server_time_unix_ms + 1 - sent_at * 1000
            self.offset_ms = sample if self.offset_ms is None else min(self.offset_ms, sample)

    def deadline_of(self, request: bridge_pb2.ToolRequest) -> float:
        """The request's deadline as a `time.monotonic()` value.

        From the bridge's deadline when it gave one (a request read late has less time left than
        its timeout_ms says), at the earliest instant it may be on this process's clock, never
        later than its timeout_ms from now.
        """
        by_timeout = time.monotonic() + request.timeout_ms / 1000
        if request.deadline_unix_ms and self.offset_ms is not None:
            return min(by_timeout, (request.deadline_unix_ms - self.offset_ms) / 1000)
        return by_timeout


@dataclass(frozen=True, slots=True)
class _Starting:
    """A request read from a bridge that acknowledges starts, waiting for its START."""

    request: bridge_pb2.ToolRequest
    ctx: ToolContext
    handler: Registered


@dataclass(slots=True)
class ActiveCall:
    """A tool request whose handler or submit is still running."""

    task: asyncio.Task[None]
    ctx: ToolContext
    cancellable: bool
    # Set once the handler has produced its outcome: from then on the runtime's
    # cancellation no longer reaches the task, so the outcome is submitted (and
    # a refusal reported), never dropped.
    submitting: bool = False


class HostEngine:
    """The stream to the bridge for one session, and the calls it brings.

    Opens the stream (to the next replica after one breaks), renews it ahead of
    its token's expiry, runs each tool request with the handler `tools` names
    and submits its outcome (on the next connection when its stream broke), and
    stops. Failures the caller cannot see go to `report`. ToolHost documents
    the behaviour; `State` and `_MOVES` say how it moves.

    Args:
        bridge_target: One address, or several replicas' addresses separated by commas.
        session_id: The session whose tools are served.
        host_name: How the bridge's logs name this host.
        channel: A channel to use instead of opening one (then not closed here).
        credentials: TLS for the channels it opens.
        token: The host's token, or a callback giving it.
        tools: The handlers and declared tools, as registered.
        report: Where failures the caller cannot see go.
    """

    def __init__(
        self,
        bridge_target: str,
        session_id: str,
        *,
        host_name: str,
        channel: grpc.aio.Channel | None,
        credentials: grpc.ChannelCredentials | None,
        token: TokenSource | None,
        tools: Registrations,
        report: Reporter,
        acknowledge_starts: bool = True,
    ) -> None:
        self.session_id = session_id
        self._acknowledge_starts = acknowledge_starts
        self.host_name = host_name
        self._tools = tools
        self._report = report
        self.state = State.IDLE
        # Why the last attempt to open the stream failed, for BridgeUnreachable.
        self.last_failure = ""
        self._own_channel = channel is None
        targets = [target.strip() for target in bridge_target.split(",") if target.strip()]
        self._channels = [channel] if channel is not None else [open_channel(t, credentials) for t in targets]
        # The replica connected to (or tried) now; the next one after a broken stream.
        self._turn = 0
        self._stub = bridge_pb2_grpc.BridgeServiceStub(self._channels[0])
        self._bearer = Bearer(token)
        # Set while the bridge refuses the host (`_refusal` says why); cleared once it takes it.
        self._refused_now = asyncio.Event()
        self._refusal: tuple[Code, str] | None = None
        # Set once a host session is open and its tools were declared (or there were none).
        self._ready = asyncio.Event()
        # Mirror the state for waiters (`_on` keeps them): a stream is open; stop() was called.
        self._connected = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self.active: dict[str, ActiveCall] = {}
        # Progress reports on their way, by request: its result waits for them (see _submit).
        self._progress_sends: dict[str, set[asyncio.Task[None]]] = {}
        self._submit_slots = asyncio.Semaphore(MAX_CONCURRENT_SUBMITS)
        self._answering: set[asyncio.Task[None]] = set()
        # Receipts still awaited for results another replica took (see _submit_with_copies).
        self._receipt_waits: set[asyncio.Task[None]] = set()
        self._call: grpc.aio.UnaryStreamCall[Any, Any] | None = None
        # Streams a renewed one took over from, read until the bridge ends them (their calls answered).
        self._retiring: set[asyncio.Task[None]] = set()
        # The host sessions whose streams are open: a result goes to the one its request came on.
        self._open_sessions: dict[str, _Link] = {}
        # Set, and replaced, each time a stream opens: submits waiting for the next connection.
        self._session_opened = asyncio.Event()
        self.host_session_id = ""
        # Requests read and not asked to start yet, by host session: asked together, in one call.
        self._to_start: dict[str, list[_Starting]] = {}
        # The host sessions with a StartToolRequests call in flight: those read meanwhile wait for it.
        self._asking: set[str] = set()
        # Requests waiting for the bridge's START, by id: a cancellation meanwhile reaches them here.
        self._starting: dict[str, ToolContext] = {}
        # The ExchangeHostWork streams of open host sessions whose bridge serves it: their start asks
        # and results go there instead of a StartToolRequests and a SubmitToolResult call each.
        self._host_work: dict[str, HostWorkLink] = {}

    # -- the state machine ------------------------------------------------
    def _on(self, trigger: Trigger) -> None:
        """Move as `_MOVES` says for `trigger`, and keep the events that mirror the state."""
        self.state = _MOVES.get((self.state, trigger), self.state)
        if self.state in _OPEN:
            self._connected.set()
        else:
            self._connected.clear()
        if self.state in _STOPPING:
            self._stop_requested.set()
        if trigger is Trigger.ENDED:
            self._ready.clear()

    @property
    def connected(self) -> bool:
        """Whether a stream is open now (the bridge said it opened the session)."""
        return self.state in _OPEN

    @property
    def stopping(self) -> bool:
        """Whether `stop()` was called."""
        return self.state in _STOPPING

    async def until_connected(self, timeout: float | None) -> None:
        """Wait until a stream is open; see `_until`."""
        await self._until(self._connected, timeout)

    async def until_ready(self, timeout: float | None) -> None:
        """Wait until a stream is open and its tools were declared; see `_until`."""
        await self._until(self._ready, timeout)

    async def until_stop_requested(self) -> None:
        """Wait until `stop()` is called."""
        await self._stop_requested.wait()

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
            raise ToolmeshError(*refusal)

    async def run(self) -> None:
        """Serve until `stop()`: open the stream, and open it again whenever it ends or falls silent."""
        backoff = Backoff()
        while not self.stopping:
            self._on(Trigger.CONNECT)
            if len(self._channels) > 1:
                await self._turn_to_answering_replica()
            try:
                await self._serve_once()
                backoff.reset()
            except grpc.aio.AioRpcError as error:
                self.last_failure = f"{error.code().name}: {error.details()}"
                if self.connected and token_expired(error):
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
                self._on(Trigger.ENDED)
                self._call = None
            if self.stopping:
                break
            self._turn = (self._turn + 1) % len(self._channels)
            self._stub = bridge_pb2_grpc.BridgeServiceStub(self._channels[self._turn])
            # Waiting to reconnect, but not past stop(): it would wait as long.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_requested.wait(), backoff.next())

    async def _turn_to_answering_replica(self) -> None:
        """Open on a replica that answers (toolmesh.host.replicas).

        The current one if it does at once, else the first of them all to; the current one still
        when none does within FIRST_EVENT_ELSEWHERE_S.
        """
        turn = await first_answering(
            self._channels, self._turn, FIRST_EVENT_ELSEWHERE_S, self._stop_requested
        )
        if turn is not None and turn != self._turn:
            self._turn = turn
            self._stub = bridge_pb2_grpc.BridgeServiceStub(self._channels[turn])

    def _refused(self, error: grpc.aio.AioRpcError) -> None:
        code = error_code(error)
        if code not in _REFUSALS:
            return
        assert code is not None
        first = self._refusal is None
        # The details start with the table's message; keep what the bridge added.
        detail = (error.details() or "").removeprefix(ERROR_TABLE[code].message).strip()
        self._refusal = (code, detail)
        self._refused_now.set()
        if first:  # once until the next connection: a host that keeps trying does not flood on_error
            self._report(code, detail, session_id=self.session_id)

    async def stop(self, runner: asyncio.Task[None] | None) -> None:
        """Close the stream, wait for `runner` (the task running `run()`), end the calls, close channels.

        See ToolHost.stop; a second call returns at once.
        """
        if self.stopping:
            return
        self._on(Trigger.STOP)
        # The results handed in on host work streams get their receipts before the streams close.
        await asyncio.gather(*[link.finish(STOP_GRACE_S) for link in self._host_work.values()])
        if self._call is not None:
            self._call.cancel()
        for retiring in list(self._retiring):
            retiring.cancel()
        if runner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        calls = list(self.active.values())
        for call in calls:
            if not call.submitting:
                call.task.cancel()
        tasks = [call.task for call in calls]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for answering in (*self._answering, *self._receipt_waits):
            answering.cancel()
        if self._own_channel:
            for channel in self._channels:
                await channel.close()
        self._on(Trigger.DRAINED)

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
            asked_at = time.monotonic()
            call = self._stub.OpenHostSession(
                bridge_pb2.OpenHostSessionRequest(
                    session_id=self.session_id,
                    host_name=self.host_name,
                    handler_names=sorted(self._tools.handlers),
                    has_generic_handler=self._tools.generic is not None,
                    replaces_host_session_id=replaces,
                    acknowledges_starts=self._acknowledge_starts,
                    reads_tool_request_batches=True,
                ),
                metadata=Bearer.with_token(token),
            )
            self._call = call
            reading = asyncio.create_task(self._read_stream(call, asked_at))
            renewal = renew_in(token)
            if renewal is None:
                await reading
                return
            done, _ = await asyncio.wait({reading}, timeout=renewal)
            if done:
                return reading.result()
            if not self.connected:
                await reading  # never opened: nothing to take over from
                return
            self._on(Trigger.RENEW)
            # Keep reading the old stream for the requests it holds, until the bridge ends it.
            replaces = self.host_session_id
            self._retiring.add(reading)
            reading.add_done_callback(self._retired)

    def _retired(self, reading: asyncio.Task[None]) -> None:
        self._retiring.discard(reading)
        if not reading.cancelled() and reading.exception() is not None:
            log.debug("a replaced host stream ended", extra={"session_id": self.session_id})

    async def _read_stream(self, call: Any, asked_at: float) -> None:
        # Until the bridge says how often it beats, allow a generous first wait; a shorter one with
        # another replica to go to (see FIRST_EVENT_ELSEWHERE_S).
        first_wait = FIRST_EVENT_S if len(self._channels) < 2 else FIRST_EVENT_ELSEWHERE_S
        silence = _Silence(asyncio.get_running_loop(), first_wait, call)
        watchdog = asyncio.create_task(silence.watch())
        try:
            await self._read_events(call, silence, asked_at)
        except asyncio.CancelledError:
            if silence.expired:
                raise TimeoutError from None
            call.cancel()
            raise
        finally:
            watchdog.cancel()

    async def _read_events(self, call: Any, silence: _Silence, asked_at: float) -> None:
        # This stream's host session: its requests' results go there, even once a renewal took over.
        stream = _Stream(asked_at)
        link: _Link | None = None
        try:
            while True:
                event = await call.read()
                silence.heard()
                if event is grpc.aio.EOF:
                    return
                if event.WhichOneof("event") == "opened":
                    stream.host_session_id = event.opened.host_session_id
                    # Asked for, and taken: the bridge starts none of this stream's requests unasked.
                    stream.starts_acknowledged = self._acknowledge_starts and event.opened.starts_acknowledged
                    link = _Link(stream.host_session_id, self._stub, silence, self._turn)
                    self._open_sessions[stream.host_session_id] = link
                    self._session_opened.set()
                    self._session_opened = asyncio.Event()
                self._on_event(event, stream, silence)
        finally:
            if link is not None:
                self._open_sessions.pop(link.host_session_id, None)
                link.end()
            # Asks and results still waiting on its host work stream fail as broken: see _told and _hand_in.
            host_work = self._host_work.pop(stream.host_session_id, None)
            if host_work is not None:
                await host_work.aclose()

    def _on_event(self, event: Any, stream: _Stream, silence: _Silence) -> None:
        kind = event.WhichOneof("event")
        host_session_id = stream.host_session_id
        if kind == "opened":
            stream.answered(event.opened.server_time_unix_ms, stream.asked_at)
            self.host_session_id = host_session_id
            silence.limit_s = _MISSED_HEARTBEATS * max(event.opened.heartbeat_interval_ms, 100) / 1000
            self._refusal = None
            self._refused_now.clear()
            self._on(Trigger.OPENED)
            if event.opened.host_work_served:
                self._open_host_work(host_session_id)
            log.info(
                "host connected",
                extra={"session_id": self.session_id, "host_session_id": self.host_session_id},
            )
            if self._tools.declared:
                declaring = asyncio.create_task(self.declare(self.host_session_id))
                declaring.add_done_callback(lambda _: self._ready.set())
            else:
                self._ready.set()
        elif kind == "tool_request":
            self._begin(event.tool_request, stream)
        elif kind == "tool_requests":
            for request in event.tool_requests.requests:
                self._begin(request, stream)
        elif kind == "cancelled":
            self._cancel(event.cancelled)
        elif kind == "heartbeat" and event.heartbeat.read_check:
            self._answer_read_check(stream, event.heartbeat.read_check)

    def _open_host_work(self, host_session_id: str) -> None:
        """Open the host session's ExchangeHostWork stream; its asks and results use it once open."""
        task = asyncio.create_task(self._link_host_work(host_session_id, self._stub))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _link_host_work(
        self, host_session_id: str, stub: bridge_pb2_grpc.BridgeServiceAsyncStub
    ) -> None:
        try:
            metadata = await self._bearer.metadata()
        except Exception as error:
            # A token callback that failed: the unary calls ask for the token again each time.
            log.debug(
                "no host work stream", extra={"session_id": self.session_id, "cause": type(error).__name__}
            )
            return
        if host_session_id in self._open_sessions and not self.stopping:
            self._host_work[host_session_id] = HostWorkLink(stub, host_session_id, metadata)

    def _answer_read_check(self, stream: _Stream, read_check: int) -> None:
        """Tell the bridge this host reads its stream: it routes requests to hosts that do."""
        task = asyncio.create_task(self._send_read_check(stream, read_check))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _send_read_check(self, stream: _Stream, read_check: int) -> None:
        request = bridge_pb2.AnswerReadCheckRequest(
            host_session_id=stream.host_session_id, read_check=read_check
        )
        try:
            with telemetry.client_call("toolmesh.v1.BridgeService/AnswerReadCheck") as traced:
                metadata = await self._bearer.metadata(traced)
                # To the stream's own bridge (its clock is the one the answer bounds); an ended
                # stream needs no answer.
                link = self._open_sessions.get(stream.host_session_id)
                if link is None:
                    return
                sent_at = time.monotonic()
                answer = await link.stub.AnswerReadCheck(
                    request, timeout=READ_CHECK_TIMEOUT_S, metadata=metadata
                )
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as error:
            # The next check asks again; a bridge that takes us for gone ends the stream.
            status = error.code().name if isinstance(error, grpc.aio.AioRpcError) else "CLOSED"
            log.debug("answering a read check failed", extra={"grpc_status": status})
            return
        # Each answer may bound the bridge's clock closer than the stream's opening did.
        stream.answered(answer.server_time_unix_ms, sent_at)

    async def declare(self, host_session_id: str) -> None:
        """Send the declared tools; a refusal goes to the error callbacks.

        After REGISTRY_UNAVAILABLE the bridge keeps the declaration and puts it later.
        """
        request = bridge_pb2.DeclareHostToolsRequest(
            host_session_id=host_session_id,
            tools=[tool_to_pb(spec) for spec in self._tools.declared.values()],
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
            self._report(code, error.details() or "", session_id=self.session_id)

    def _begin(self, request: bridge_pb2.ToolRequest, stream: _Stream) -> None:
        """Run the request; from a bridge that acknowledges starts, only once it says START."""
        ctx = ToolContext(
            session_id=request.session_id,
            turn_id=request.turn_id,
            tool_request_id=request.tool_request_id,
            tool_name=request.tool_name,
            deadline=stream.deadline_of(request),
            reporter=self._progress_reporter(request.tool_request_id),
        )
        handler = self._tools.handlers.get(ctx.tool_name) or self._tools.generic
        if handler is not None and ctx.time_remaining() <= 0:
            # Read after its deadline (this process paused, or the stream lagged): the caller has
            # TOOL_TIMEOUT, or is about to.
            log.info("tool request not started", extra=_ids(ctx) | {"cause": "DEADLINE_PASSED"})
            return
        if handler is None or not stream.starts_acknowledged or request.redeliverable:
            # Without a handler nothing runs: the answer (TOOL_HANDLER_NOT_FOUND) needs no START.
            # A read-only or idempotent request goes to another host if this one leaves, started
            # or not: a START would tell the bridge nothing (its result counts as the start).
            self._run(request, ctx, handler, stream.host_session_id)
            return
        self._starting[ctx.tool_request_id] = ctx
        self._queue_start(stream.host_session_id, _Starting(request, ctx, handler))

    def _queue_start(self, host_session_id: str, starting: _Starting) -> None:
        batch = self._to_start.setdefault(host_session_id, [])
        batch.append(starting)
        if len(batch) == 1 and host_session_id not in self._asking:
            # Those read in this turn of the loop go in one call; while it is in flight, those read
            # meanwhile wait and go together in the next (one call per round trip, not per request).
            # On a host work stream they go in one message at the end of the turn.
            asyncio.get_running_loop().call_soon(self._ask_to_start, host_session_id)

    def _ask_to_start(self, host_session_id: str) -> None:
        batch = self._to_start.pop(host_session_id, [])
        if not batch or self.stopping:
            return
        host_work = self._host_work.get(host_session_id)
        if host_work is not None and not host_work.closed:
            for starting in batch:
                told = host_work.ask_to_start(starting.ctx.tool_request_id)
                told.add_done_callback(functools.partial(self._told, host_session_id, starting))
            return
        if len(batch) > MAX_CALLS_PER_MESSAGE:
            self._to_start[host_session_id] = batch[MAX_CALLS_PER_MESSAGE:]
        self._asking.add(host_session_id)
        task = asyncio.create_task(self._start_when_told(host_session_id, batch[:MAX_CALLS_PER_MESSAGE]))
        self._answering.add(task)

        def asked(done: asyncio.Task[None]) -> None:
            self._answering.discard(done)
            self._asking.discard(host_session_id)
            if host_session_id in self._to_start:
                self._ask_to_start(host_session_id)

        task.add_done_callback(asked)

    async def _start_when_told(self, host_session_id: str, batch: list[_Starting]) -> None:
        """Ask the bridge to start `batch`, and run those it says START for; none if it does not answer."""
        request = bridge_pb2.StartToolRequestsRequest(
            host_session_id=host_session_id,
            tool_request_ids=[starting.ctx.tool_request_id for starting in batch],
        )
        wait_s = min(max(1.0, *(starting.ctx.time_remaining() for starting in batch)), START_TIMEOUT_S)
        verdicts: dict[str, bridge_pb2.ToolStartVerdict.ValueType] = {}
        try:
            with telemetry.client_call("toolmesh.v1.BridgeService/StartToolRequests") as metadata:
                response = await self._stub.StartToolRequests(
                    request, timeout=wait_s, metadata=await self._bearer.metadata(metadata)
                )
            verdicts = {start.tool_request_id: start.verdict for start in response.starts}
        except asyncio.CancelledError:
            for starting in batch:
                self._starting.pop(starting.ctx.tool_request_id, None)
            raise
        except Exception as error:
            # A transport failure, a refusal, a token callback that failed: the answer is unknown,
            # and running without it could run the request twice (the bridge may send it elsewhere).
            status = error.code().name if isinstance(error, grpc.aio.AioRpcError) else type(error).__name__
            log.warning(
                "tool requests not started: the bridge did not answer",
                extra={"session_id": self.session_id, "count": len(batch), "cause": status},
            )
        for starting in batch:
            verdict = verdicts.get(starting.ctx.tool_request_id)
            self._act_on(starting, host_session_id, verdict, answered=bool(verdicts))

    def _told(
        self, host_session_id: str, starting: _Starting, told: asyncio.Future[bridge_pb2.ToolStart]
    ) -> None:
        """The host work stream's answer to one ask: run on START.

        Asked again by StartToolRequests when the stream broke first (a START given on it is
        ALREADY_STARTED then: not run).
        """
        if told.cancelled() or told.exception() is not None:
            if host_session_id in self._open_sessions and not self.stopping:
                self._queue_start(host_session_id, starting)
            else:
                self._act_on(starting, host_session_id, None, answered=False)
            return
        self._act_on(starting, host_session_id, told.result().verdict, answered=True)

    def _act_on(
        self,
        starting: _Starting,
        host_session_id: str,
        verdict: bridge_pb2.ToolStartVerdict.ValueType | None,
        *,
        answered: bool,
    ) -> None:
        """Run the request on START (unless cancelled or stopping meanwhile), else say why not."""
        ctx = starting.ctx
        self._starting.pop(ctx.tool_request_id, None)
        verdict = bridge_pb2.TOOL_START_VERDICT_UNSPECIFIED if verdict is None else verdict
        # A START read after the deadline runs nothing either: _execute checks it as the handler begins.
        if verdict == bridge_pb2.TOOL_START_VERDICT_START and not ctx.cancelled and not self.stopping:
            self._run(starting.request, ctx, starting.handler, host_session_id)
        elif answered:
            cause = bridge_pb2.ToolStartVerdict.Name(verdict).removeprefix("TOOL_START_VERDICT_")
            if verdict == bridge_pb2.TOOL_START_VERDICT_START:
                cause = "CANCELLED" if ctx.cancelled else "SHUTTING_DOWN"
            log.info("tool request not started", extra=_ids(ctx) | {"cause": cause})

    def _run(
        self,
        request: bridge_pb2.ToolRequest,
        ctx: ToolContext,
        handler: Registered | None,
        host_session_id: str,
    ) -> None:
        task = asyncio.create_task(
            self._serve(handler, request.arguments_json, ctx, host_session_id, dict(request.trace_context))
        )
        # Async handlers are cancelled on the runtime's word; a sync handler's
        # thread cannot be, so it finishes and its late result is refused.
        self.active[ctx.tool_request_id] = ActiveCall(task, ctx, handler is not None and handler.is_async)
        task.add_done_callback(lambda _: self.active.pop(ctx.tool_request_id, None))

    def _progress_reporter(self, tool_request_id: str) -> ProgressReporter:
        """What `ctx.report_progress` calls for the request.

        On the loop it gives the coroutine to await; from a sync handler's worker
        thread it sends the report from the loop and returns at once.
        """
        loop = asyncio.get_running_loop()

        def send(progress: float, total: float | None, message: str | None) -> asyncio.Task[None]:
            task = asyncio.ensure_future(self._report_progress(tool_request_id, progress, total, message))
            sending = self._progress_sends.setdefault(tool_request_id, set())
            sending.add(task)

            def sent(_: object) -> None:
                sending.discard(task)
                if not sending and self._progress_sends.get(tool_request_id) is sending:
                    del self._progress_sends[tool_request_id]

            task.add_done_callback(sent)
            return task

        def report(progress: float, total: float | None, message: str | None) -> Awaitable[None]:
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:  # no loop in this thread: a worker thread
                on_loop = False
            if on_loop:
                return send(progress, total, message)
            # Queued on the loop before the handler's return is: its result waits for it too.
            loop.call_soon_threadsafe(send, progress, total, message)
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
        reason = "timeout" if cancelled.reason == bridge_pb2.CANCEL_REASON_TIMEOUT else "cancelled"
        starting = self._starting.get(cancelled.tool_request_id)
        if starting is not None:
            starting.cancellation.set(reason)  # START or not, it is not run now
            return
        active = self.active.get(cancelled.tool_request_id)
        if active is None:
            return
        active.ctx.cancellation.set(reason)
        log.info("tool call cancelled", extra=_ids(active.ctx) | {"reason": reason})
        if active.cancellable and not active.submitting:
            active.task.cancel()

    async def _serve(
        self,
        handler: Registered | None,
        arguments_json: str,
        ctx: ToolContext,
        host_session_id: str,
        trace_context: dict[str, str],
    ) -> None:
        # The invocation's trace continues here: the request carried its context.
        with (
            telemetry.execute_tool_span(
                ctx.tool_name, ctx.tool_request_id, SpanKind.SERVER, trace_context
            ) as span,
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
            active = self.active.get(ctx.tool_request_id)
            if active is not None:
                active.submitting = True
            telemetry.record_tool_outcome(outcome)
            await self._submit(outcome, ctx, host_session_id)

    async def _execute(
        self, registered: Registered | None, arguments_json: str, ctx: ToolContext
    ) -> Outcome | None:
        """Run the handler; None when it was cancelled and produced nothing."""
        if registered is None:
            log.warning("no handler for tool", extra=_ids(ctx))
            return Outcome.runtime_error(
                Code.TOOL_HANDLER_NOT_FOUND, f"No handler for {ctx.tool_name}.", {"tool": ctx.tool_name}
            )
        if ctx.time_remaining() <= 0:
            # Told to start in time (START, or a request read in time), begun late: the process paused
            # in between, or read the START late. The caller has TOOL_TIMEOUT, or is about to.
            log.info("tool request not started", extra=_ids(ctx) | {"cause": "DEADLINE_PASSED"})
            return None
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
            if self.stopping:
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
            self._report(Code.TOOL_HANDLER_ERROR, type(exc).__name__, **_ids(ctx))
            return Outcome.runtime_error(
                Code.TOOL_HANDLER_ERROR, "", {"tool": ctx.tool_name, "exception": type(exc).__name__}
            )
        converted = convert_return(value)
        if converted.refused_because is not None:
            self._report(
                Code.SUBMIT_TOOL_RESULT_FAILED,
                converted.outcome.failure.message if converted.outcome.failure else "",
                cause=converted.refused_because.value,
                **_ids(ctx),
            )
        return converted.outcome

    async def _submit(self, outcome: Outcome, ctx: ToolContext, host_session_id: str) -> None:
        """Hand the outcome to the bridge, retrying failures that may pass until the call's deadline.

        Those are the transport's own and refusals whose code is retryable.

        Ends with the outcome delivered or a SUBMIT_TOOL_RESULT_FAILED report,
        whatever happens meanwhile: a refusal, a transport that stays down, this
        host stopping. When the stream broke meanwhile (its bridge replica may be
        gone), it waits for the next connection and hands the outcome in there,
        naming the same request. Sending the same outcome again is safe: the
        bridge accepts one outcome per request and says whether it was this one
        (REQUEST_ENDED, ended=answered).
        """
        try:
            sending = self._progress_sends.pop(ctx.tool_request_id, None)
            if sending:
                # A report made before the result goes before it: once the request has ended, the
                # bridge drops a report (REQUEST_ENDED). Each send is bounded (PROGRESS_TIMEOUT_S).
                await asyncio.wait(sending)
            cause, detail = await self._hand_in(outcome, ctx, host_session_id)
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

    async def _hand_in(
        self, outcome: Outcome, ctx: ToolContext, host_session_id: str
    ) -> tuple[str | None, str]:
        """As `_deliver`, on the host session's host work stream first when it has one (untraced).

        A result the stream refused, or whose receipt did not come (the stream broke, or the bridge
        left it unanswered for an attempt's share of the time), goes to `_deliver`, which knows what
        to do with every answer. With several bridge addresses, a receipt that did not come with
        nothing else heard on the stream meanwhile gives that stream up first, as `_deliver` does.
        """
        link = self._open_sessions.get(host_session_id)
        host_work = self._host_work.get(host_session_id)
        # Traced, a result keeps its own SubmitToolResult spans, client and server, in the call's trace.
        if link is not None and host_work is not None and not telemetry.enabled():
            submission = bridge_pb2.ToolResultSubmission(
                tool_request_id=ctx.tool_request_id, outcome=outcome_to_pb(outcome)
            )
            if host_work.can_carry(submission):
                heard = link.silence.events
                bound = self._attempt_bound(ctx.deadline + SUBMIT_GRACE_S - time.monotonic())
                taken, copied = await self._submit_with_copies(link, host_work, submission, bound, heard)
                if taken:
                    return None, ""
                if taken is None and await self._leave_if_silent(link, heard):
                    log.warning("result receipt unanswered; leaving the bridge", extra=_ids(ctx))
                return await self._deliver(outcome, ctx, host_session_id, tried=taken is None or copied)
        return await self._deliver(outcome, ctx, host_session_id)

    async def _submit_with_copies(
        self,
        link: _Link,
        host_work: HostWorkLink,
        submission: bridge_pb2.ToolResultSubmission,
        bound: float,
        heard: int,
    ) -> tuple[bool | None, bool]:
        """`host_work.submit(submission, bound)`, and whether copies went to the other replicas.

        They go when its receipt is not in after COPY_AFTER_S with nothing heard from its replica
        since `heard` (its count of events as the result went out; toolmesh.host.copies); one that
        takes the result ends the wait (True).
        """
        if len(self._channels) < 2:
            return await host_work.submit(submission, bound), False
        sending = asyncio.ensure_future(host_work.submit(submission, bound))
        copying: asyncio.Future[bool] | None = None
        kept = False
        try:
            await asyncio.wait((sending,), timeout=COPY_AFTER_S)
            if sending.done() or link.silence.heard_since(heard):
                return await sending, False
            others = [bridge_pb2_grpc.BridgeServiceStub(channel) for channel in self._others(link)]
            request = bridge_pb2.SubmitToolResultRequest(
                host_session_id=link.host_session_id,
                tool_request_id=submission.tool_request_id,
                outcome=submission.outcome,
            )
            log.info(
                "result receipt late; copies to the other bridge replicas",
                extra={"tool_request_id": submission.tool_request_id},
            )
            copying = asyncio.ensure_future(
                hand_in_copies(others, request, max(bound, 0.0), await self._bearer.metadata())
            )
            await asyncio.wait((sending, copying), return_when=asyncio.FIRST_COMPLETED)
            if not sending.done() and copying.result():
                # The receipt is still awaited, to leave a replica that stays silent.
                kept = True
                waiting = asyncio.create_task(self._leave_if_unanswered(link, sending, heard))
                self._receipt_waits.add(waiting)
                waiting.add_done_callback(self._receipt_waits.discard)
                return True, True
            return await sending, True
        finally:
            if copying is not None:
                copying.cancel()
            if not kept:
                sending.cancel()

    async def _leave_if_unanswered(
        self, link: _Link, sending: asyncio.Future[bool | None], heard: int
    ) -> None:
        """Give `link`'s stream up when `sending` (a result another replica took) gets no receipt.

        With nothing heard on it since `heard` either, its replica is frozen or cut off: left as
        for any other result (see _hand_in).
        """
        if await sending is None and await self._leave_if_silent(link, heard):
            log.warning(
                "result receipt unanswered; leaving the bridge", extra={"session_id": self.session_id}
            )

    def _others(self, link: _Link) -> list[grpc.aio.Channel]:
        """The channels to the bridge replicas other than `link`'s."""
        return [channel for turn, channel in enumerate(self._channels) if turn != link.turn]

    def _attempt_bound(self, window: float) -> float:
        """How long one submit attempt may wait, of the `window` left.

        All of it with one bridge address, else its share (another replica to go to).
        """
        if len(self._channels) > 1:
            return min(window, max(SUBMIT_ATTEMPT_MIN_S, min(window / 3, SUBMIT_ATTEMPT_MAX_S)))
        return window

    async def _leave_if_silent(self, link: _Link, heard: int) -> bool:
        """Give `link`'s stream up when nothing was heard on it since `heard`; whether it did.

        `heard`: its count of events as the submit went out.

        Only when another replica answers its health check (within OTHERS_ANSWER_S): this one is
        frozen or cut off. When none does, every replica is (or this host is cut off from all), and
        the host stays: leaving would end there, once it comes back, the requests its handlers ran
        (`bench.chaos --seed 137 --concurrency 8`: a host left its replica 36 ms before it thawed,
        the other frozen too, and two results were lost).
        """
        if link.cut or len(self._channels) < 2 or link.silence.heard_since(heard):
            return False
        if not await any_answers(self._others(link), OTHERS_ANSWER_S):
            log.warning(
                "bridge silent and no other replica answers; staying", extra={"session_id": self.session_id}
            )
            return False
        if link.cut or link.silence.heard_since(heard):
            return False  # given up meanwhile, or heard from: no longer silent
        link.silence.declare()
        link.end()  # at once: the stream's reader ends it too, a turn of the loop later
        return True

    async def _deliver(
        self, outcome: Outcome, ctx: ToolContext, host_session_id: str, *, tried: bool = False
    ) -> tuple[str | None, str]:
        """Send until the bridge takes the outcome (None) or says why not (the cause and its message).

        `tried`: it was sent before and may have got through (its answer was lost).

        Everything happens before the call's deadline and LATE_SUBMIT_S (a bridge that shares the
        ledger keeps a late result beside the caller's TOOL_TIMEOUT; one that does not refuses it
        with REQUEST_ENDED, which ends the attempts). A submit in flight when
        its stream ends (broken, or given up as silent) is cut and sent again on the next
        connection. With several bridge addresses, an attempt the bridge leaves unanswered for its
        share of the time (see SUBMIT_ATTEMPT_MIN_S), with nothing else heard on the stream
        meanwhile, gives that stream up (the bridge is frozen or cut off) and goes to the next
        replica in the time left.
        """
        request = bridge_pb2.SubmitToolResultRequest(
            host_session_id=host_session_id,
            tool_request_id=ctx.tool_request_id,
            outcome=outcome_to_pb(outcome),
        )
        give_up_at = ctx.deadline + LATE_SUBMIT_S
        attempt = 1 if tried else 0
        # The last coded refusal: the cause reported when the window then ends in the transport.
        refused: Code | None = None
        while True:
            attempt += 1
            link = self._open_sessions.get(request.host_session_id)
            if link is None or link.cut:
                # Its stream ended: hand the result in on the next connection, naming the same request.
                link = await self._next_link(request.host_session_id, give_up_at)
                if link is None:
                    return Code.TRANSPORT_FAILED.value, "No connection to a bridge in time."
                request.host_session_id = link.host_session_id
            # Before the deadline, an attempt's share is of the time until it (and the grace), so
            # that a frozen replica is left for the next one in time; after it, of the late window.
            now = time.monotonic()
            in_time = ctx.deadline + SUBMIT_GRACE_S - now
            bound = self._attempt_bound(in_time if in_time > 0 else give_up_at - now)
            heard = link.silence.events
            try:
                await self._submit_once(link, request, bound)
                return None, ""
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not link.cut or (task is not None and task.cancelling()):
                    raise
                continue  # cut with its stream, not by stop(): the next connection takes it
            except grpc.aio.UsageError:
                return Code.TRANSPORT_FAILED.value, "The channel to the bridge is closed."
            except grpc.aio.AioRpcError as error:
                info = error_info(error)
                reason = code_for_reason(info.reason) if info is not None else None
                if attempt > 1 and answered_before(info):
                    return None, ""  # an earlier attempt got through; its answer was lost on the way back
                remaining = give_up_at - time.monotonic()
                if (
                    error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                    and remaining > 0
                    and await self._leave_if_silent(link, heard)
                ):
                    # Not a word from that bridge since the submit went out: its stream is given up
                    # (as when its heartbeats stop) and the result goes to the next replica.
                    log.warning("submit unanswered; leaving the bridge", extra=_ids(ctx))
                    continue
                # A refusal whose code is retryable (STORE_UNAVAILABLE: the bridge could not read the
                # ledger yet), or no code of ours: the transport's own failure, retried while the
                # table says it may pass, until the late window's end.
                if reason is not None:
                    transient = ERROR_TABLE[reason].retryable
                else:
                    transient = status_of(error.code()) in RETRYABLE_STATUSES
                if transient and remaining > 0 and not self.stopping:
                    if reason is not None:
                        refused = reason
                        log.info("submit refused; trying again", extra=_ids(ctx) | {"cause": reason.value})
                    await asyncio.sleep(min(0.05 * 2**attempt, 1.0, remaining))
                    continue
                cause = (reason or refused or Code.TRANSPORT_FAILED).value
                log.warning(
                    "submit failed", extra=_ids(ctx) | {"cause": cause, "grpc_status": error.code().name}
                )
                return cause, error.details() or ""

    async def _submit_once(
        self, link: _Link, request: bridge_pb2.SubmitToolResultRequest, timeout_s: float
    ) -> None:
        """One SubmitToolResult on `link`'s channel, cut (CancelledError) if its stream ends first."""
        async with self._submit_slots:
            with telemetry.client_call("toolmesh.v1.BridgeService/SubmitToolResult") as metadata:
                call = link.stub.SubmitToolResult(
                    request, timeout=max(timeout_s, 0.0), metadata=await self._bearer.metadata(metadata)
                )
                link.submits.add(call)
                try:
                    await call
                finally:
                    link.submits.discard(call)

    async def _next_link(self, old_host_session_id: str, give_up_at: float) -> _Link | None:
        """The open host session after `old_host_session_id`'s stream ended.

        None if none opens by `give_up_at` (a `time.monotonic()` value).
        """
        while True:
            link = self._open_sessions.get(self.host_session_id)
            if link is not None and not link.cut and link.host_session_id != old_host_session_id:
                return link
            left = give_up_at - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._session_opened.wait(), left)

    def _submit_failed(self, ctx: ToolContext, cause: str, detail: str) -> None:
        self._report(Code.SUBMIT_TOOL_RESULT_FAILED, detail, cause=cause, **_ids(ctx))


def _ids(ctx: ToolContext) -> dict[str, str]:
    return {
        "session_id": ctx.session_id,
        "turn_id": ctx.turn_id,
        "tool_request_id": ctx.tool_request_id,
        "tool_name": ctx.tool_name,
    }
