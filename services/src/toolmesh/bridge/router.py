"""The bridge's domain: connected handler hosts, pending tool requests, their outcomes.

Every pending request ends exactly once (answered, timed out, cancelled, or
its host gone); whichever comes first wins, and everything after it is
refused with a precise reason. All of it runs on one event loop, so each
transition is atomic.

A request goes to a host of its session that can handle the tool, one that
reads its stream first (toolmesh.bridge.reading), then one with a named
handler, then the least loaded. A host that stopped reading is taken for gone.

A host that acknowledges starts asks (`start_requests`) before it runs each request, and is
told START at most once per request, only while the request is pending on it: so a request
it was never told START for has not run, and when the host goes away it goes to another host
of the session (or waits for the next), as a redeliverable one does.

With a start fence (a ledger shared with the invocation service), a request that carries a
dispatch generation and is not redeliverable is marked started in the ledger (compare-and-set
on that generation) before its host may start it: before START, or, for a host that does not
acknowledge starts, before it is sent. The invocation service sends a request whose bridge
replica was lost through another only if no start was marked (it moves the generation on), so
at most one delivery ever starts. A mark that finds the invocation not stored yet (ABSENT: the
invocation service sends some requests while their claims are on their way,
toolmesh.invocation.early) is asked again until it is, within the same bounds. A mark refused
here (the request went elsewhere, or the ledger cannot be reached for MARK_RETRY_S or half the
time the request has left: a Redis that restarts in that time costs nothing) ends the request
on this replica as not run (TOOL_HOST_UNAVAILABLE, with `startFence` in its details), which no
bridge records in the ledger.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from toolmesh.bridge.acceptance import check_outcome
from toolmesh.bridge.progress import ProgressGate, ProgressSink
from toolmesh.bridge.reading import READ_CHECK_AFTER_S, ReadChecks, Reading
from toolmesh.core.calls import ToolRequest
from toolmesh.core.deadlines import Deadlines
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.limits import MAX_CALLS_PER_MESSAGE, READ_CHECK_TIMEOUT_MS
from toolmesh.core.names import require_id, require_tool_name
from toolmesh.core.outcome import Outcome
from toolmesh.core.progress import ProgressVerdict, ToolProgress, capped_message, valid_numbers
from toolmesh.core.wire import time_left_ms
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.rules.shares import Shares
from toolmesh.store.ledger import MarkVerdict, StartMark

log = logging.getLogger("toolmesh.bridge")

READ_CHECK_TIMEOUT_S = READ_CHECK_TIMEOUT_MS / 1000


class StartVerdict(enum.Enum):
    """What `start_requests` answers for one request (the wire's ToolStartVerdict)."""

    START = "start"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    ENDED = "ended"
    UNKNOWN = "unknown"
    ALREADY_STARTED = "already_started"


class EndReason(enum.Enum):
    ANSWERED = "answered"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    HOST_GONE = "host_gone"


# What asking to start a request that has ended answers.
_START_AFTER_END = {
    EndReason.ANSWERED: StartVerdict.ENDED,
    EndReason.TIMED_OUT: StartVerdict.TIMED_OUT,
    EndReason.CANCELLED: StartVerdict.CANCELLED,
    EndReason.HOST_GONE: StartVerdict.ENDED,
}

# How a refused late submit says why the request had ended.
_ENDED_BECAUSE = {
    EndReason.ANSWERED: "It was already answered.",
    EndReason.TIMED_OUT: "It timed out.",
    EndReason.CANCELLED: "It was cancelled.",
    EndReason.HOST_GONE: "Its host went away.",
}


@dataclass(frozen=True, slots=True)
class ToolRequestCancelled:
    """Tells a host to stop a request it holds (the wire's ToolRequestCancelled)."""

    tool_request_id: str
    reason: EndReason


@dataclass(frozen=True, slots=True)
class Heartbeat:
    # Nonzero: a read check, for the host to answer (AnswerReadCheck).
    read_check: int = 0


@dataclass(frozen=True, slots=True)
class _Close:
    """Tells a host stream to end, failing with `error` (None: ending without one)."""

    error: ToolmeshError | None


HostEvent = ToolRequest | ToolRequestCancelled | Heartbeat
_CLOSE = _Close(ToolmeshError(Code.SHUTTING_DOWN))
# A host session another took over from (OpenHostSessionRequest.replaces_host_session_id), answered.
_RETIRED = _Close(None)


@dataclass(eq=False)
class HostSession:
    host_session_id: str
    session_id: str
    host_name: str
    handler_names: frozenset[str]
    has_generic_handler: bool
    # The tools it declared (DeclareHostTools): served as by named handlers.
    declared_names: frozenset[str] = frozenset()
    _events: asyncio.Queue[HostEvent | _Close] = field(default_factory=asyncio.Queue)
    in_flight: dict[str, PendingRequest] = field(default_factory=dict)
    checks: ReadChecks = field(default_factory=ReadChecks)
    closed: bool = False
    # Another host session took over from it: no new requests; its stream ends once it has none.
    retiring: bool = False
    # The grant key of the token that opened it (None without authentication): its share.
    grant: str | None = None
    # It asks before starting each request (start_requests) and runs none it was not told START for.
    acknowledges_starts: bool = False
    # Called once when it closes: what it alone kept open (its ExchangeHostWork stream) ends too.
    on_close: set[Callable[[], None]] = field(default_factory=set)
    _beat: asyncio.TimerHandle | None = None
    # An event `ready_requests` took from the queue that is not a request: next_event's next one.
    _held: HostEvent | _Close | None = None

    def preference(self, tool_name: str) -> int:
        """2: a named handler, 1: a generic one, 0: none (the host SDK will say so)."""
        if tool_name in self.handler_names or tool_name in self.declared_names:
            return 2
        return 1 if self.has_generic_handler else 0

    def send(self, event: HostEvent | _Close) -> None:
        if not self.closed:
            self._events.put_nowait(event)

    def start_heartbeats(self, interval_s: float, heartbeat: Callable[[], Heartbeat]) -> None:
        """Queue `heartbeat()` every `interval_s` until the session closes.

        A timer, not a timeout around each wait: that would cost a task per event.
        """
        loop = asyncio.get_running_loop()

        def beat() -> None:
            if not self.closed:
                self._events.put_nowait(heartbeat())
                self._beat = loop.call_later(interval_s, beat)

        self._beat = loop.call_later(interval_s, beat)

    def stop_heartbeats(self) -> None:
        if self._beat is not None:
            self._beat.cancel()

    async def next_event(self) -> HostEvent | None:
        """The next event for the host: a request, a cancellation or a heartbeat; None: the stream ends."""
        if self._held is not None:
            event, self._held = self._held, None
        else:
            event = await self._events.get()
        if isinstance(event, _Close):
            if event.error is None:
                return None
            raise event.error
        return event

    def ready_requests(self, items: int, budget_bytes: int) -> list[ToolRequest]:
        """The tool requests queued now, oldest first: up to `items`, and while their arguments add up
        to at most `budget_bytes`. Stops at the first event that is not a request (kept for
        next_event, so that the order holds); never waits."""
        ready: list[ToolRequest] = []
        total = 0
        while len(ready) < items and self._held is None and not self._events.empty():
            event = self._events.get_nowait()
            if not isinstance(event, ToolRequest) or total + len(event.arguments_json) > budget_bytes:
                self._held = event
                break
            ready.append(event)
            total += len(event.arguments_json)
        return ready


Settle = Callable[[Outcome], None]


class StartFence(Protocol):
    """Where starts are marked (the shared ledger: toolmesh.contracts.ledger.Ledger.mark_started)."""

    async def mark_started(self, marks: Sequence[StartMark]) -> list[MarkVerdict]: ...


# How long a start waits for a ledger it cannot reach (a Redis restarting), at most, and at most
# half the time the request has left: a host waits longer than that for its answer (its time
# left, 1 s at least, up to 10 s). Tried again after 50 ms, doubling up to 500 ms.
MARK_RETRY_S = 4.0
MARK_BACKOFF_S = (0.05, 0.5)
# An invocation the ledger does not hold yet is asked for again after 5 ms, doubling (its claim is
# usually there within a few).
ABSENT_BACKOFF_S = 0.005

# The details' key of an outcome the start fence ended a request with on this replica: nothing ran.
START_FENCE = "startFence"


@dataclass(eq=False, slots=True)
class PendingRequest:
    request: ToolRequest
    # None while a redeliverable request waits for a host of its session.
    host: HostSession | None
    # Called once with the outcome; never for a request that was cancelled.
    settle: Settle
    started: float
    # The read check its host had not answered when the request was sent after it (0: none).
    after_check: int = 0
    # Where its progress reports go, rate-limited; None when nobody listens.
    progress: ProgressGate | None = None
    # Its host may have started it: told START, or it reported progress or answered. A host that
    # does not acknowledge starts may have as soon as it was sent: this then stays False unread.
    host_started: bool = False
    # A fenced request whose START its host asked for, while its start is being marked in the
    # ledger: START is not told until then, so if its host leaves meanwhile it never started.
    marking: bool = False
    # The tool's timeout, reported with TOOL_TIMEOUT: request.timeout_ms is what the bridge gave
    # it, less when its invocation's deadline was nearer.
    tool_timeout_ms: int = 0
    # Its dispatch generation when its start is fenced (Router's `fence`); 0: not fenced.
    generation: int = 0

    @property
    def ends_at(self) -> float:
        """When its time is up, on the monotonic clock (this bridge's deadline of it)."""
        return self.started + self.request.timeout_ms / 1000


@dataclass(frozen=True, slots=True)
class _Ended:
    host_session_id: str
    reason: EndReason


class RouterObserver(Protocol):
    """What the router tells whoever watches it (metrics): the one seam for it.

    Called on the router's loop at fixed points; the router knows nothing of what it does.
    """

    def host_opened(self, host: HostSession) -> None: ...

    def host_closed(self, host: HostSession) -> None: ...


class NoRouterObserver:
    """The default RouterObserver: tells nobody anything."""

    __slots__ = ()

    def host_opened(self, host: HostSession) -> None:
        return None

    def host_closed(self, host: HostSession) -> None:
        return None


class Router:
    """Connected hosts and pending requests; tells `observer` what happens (by default, nobody)."""

    def __init__(
        self,
        *,
        heartbeat_s: float = 5.0,
        ended_memory: int = 50_000,
        observer: RouterObserver | None = None,
        limits: Limits = DEFAULT_LIMITS,
        fence: StartFence | None = None,
        mark_retry_s: float = MARK_RETRY_S,
    ) -> None:
        """`fence`: where the starts of requests carrying a dispatch generation are marked before
        a host may start them (None: not fenced); `mark_retry_s`: how long a mark is tried again
        while the fence's store cannot be reached."""
        self.heartbeat_s = heartbeat_s
        self.fence = fence
        self._mark_retry_s = mark_retry_s
        # This process's name on its marks: a mark asked again after a lost reply finds its own.
        self._marker = secrets.token_hex(8)
        # Marks of starts for hosts that do not acknowledge starts, under way.
        self._marking: set[asyncio.Task[None]] = set()
        self._limits = limits
        self._observer: RouterObserver = observer or NoRouterObserver()
        self._hosts: dict[str, HostSession] = {}
        self._by_session: dict[str, list[HostSession]] = {}
        self._pending: dict[str, PendingRequest] = {}
        # Each pending request's deadline, on one timer of the loop (toolmesh.core.deadlines).
        self._deadlines: Deadlines[PendingRequest] = Deadlines(self._expire)
        # Redeliverable requests whose host left, by session, waiting for another host.
        self._waiting: dict[str, list[PendingRequest]] = {}
        # Recently ended requests, so a late submit learns why it is refused.
        self._ended: OrderedDict[str, _Ended] = OrderedDict()
        self._ended_memory = ended_memory
        self._turn = itertools.count()
        # Called with each host session that opens, before requests waiting for it are delivered.
        self.opened_hooks: list[Callable[[HostSession], None]] = []
        self._read_checks = itertools.count(1)
        # Called with each host session that ends, after its requests are settled.
        self.closed_hooks: list[Callable[[HostSession], None]] = []
        self._shutting_down = False
        # Host sessions open here: per grant (its token's subject, over all its sessions) and in all.
        self._open = Shares(
            limits,
            "host_sessions",
            "host_sessions_per_grant",
            what="host sessions",
            retry_delay_s=heartbeat_s,
        )

    def open_host(
        self,
        session_id: str,
        host_name: str,
        handler_names: Iterable[str],
        has_generic_handler: bool,
        replaces: str = "",
        *,
        grant: str | None = None,
        acknowledges_starts: bool = False,
    ) -> HostSession:
        """A new host session; `replaces`: one of the same session it takes over from (or "");
        `grant`: the grant key of the host's token (its subject; None without authentication);
        `acknowledges_starts`: it asks before starting each request (`start_requests`)."""
        if self._shutting_down:
            # A host opening now would be cut off at once: let it find a bridge that stays.
            raise ToolmeshError(Code.SHUTTING_DOWN)
        require_id(session_id, "session_id")
        if len(self._by_session.get(session_id, ())) >= self._limits.host_sessions_per_session:
            # Per replica: a host session is a stream this process holds, released when it ends.
            raise self._limits.used_up(
                "host_sessions_per_session",
                "The session has as many host sessions open as allowed; one must end first.",
                self.heartbeat_s,
                sessionId=session_id,
            )
        names = frozenset(handler_names)
        for name in names:
            require_tool_name(name)
        self._open.take(grant)
        host = HostSession(
            host_session_id=f"hs_{secrets.token_hex(12)}",
            session_id=session_id,
            host_name=host_name[:128],
            handler_names=names,
            has_generic_handler=has_generic_handler,
            grant=grant,
            acknowledges_starts=acknowledges_starts,
        )
        self._hosts[host.host_session_id] = host
        self._by_session.setdefault(session_id, []).append(host)
        host.start_heartbeats(self.heartbeat_s, lambda: self._heartbeat(host))
        host.send(self._read_check(host))  # read right after `opened`: the host reads its stream
        self._observer.host_opened(host)
        log.info(
            "host connected",
            extra={"session_id": session_id, "host_session_id": host.host_session_id, "host": host.host_name},
        )
        for hook in self.opened_hooks:
            hook(host)
        self._retire(self._hosts.get(replaces), host)
        waiting = self._waiting.pop(session_id, [])
        for pending in waiting:
            if host.preference(pending.request.tool_name):
                self._deliver(pending, host, again=True)
            else:
                self._waiting.setdefault(session_id, []).append(pending)
        return host

    def _retire(self, old: HostSession | None, new: HostSession) -> None:
        """`old` gets no new requests; its stream ends once those it holds are answered."""
        if old is None or old is new or old.session_id != new.session_id:
            return
        old.retiring = True
        if not old.in_flight:
            old.send(_RETIRED)

    def host(self, host_session_id: str, sessions: Container[str] | None = None) -> HostSession:
        """The open host session of that id; raise ToolmeshError(HOST_SESSION_UNKNOWN) if there is none,
        or if it serves a session other than `sessions` (None: all)."""
        host = self._hosts.get(host_session_id)
        if host is None or (sessions is not None and host.session_id not in sessions):
            raise ToolmeshError(Code.HOST_SESSION_UNKNOWN, "", {"hostSessionId": host_session_id})
        return host

    def holds(self, host_session_id: str) -> bool:
        """Whether the host session of that id is open here."""
        return host_session_id in self._hosts

    def serves(self, session_id: str) -> bool:
        """Whether a host of the session is connected."""
        return bool(self._by_session.get(session_id))

    def answer_read_check(
        self, host_session_id: str, read_check: int, sessions: Container[str] | None = None
    ) -> None:
        """The host has read its stream up to the heartbeat carrying `read_check`.

        Raises ToolmeshError(HOST_SESSION_UNKNOWN) as `host` does; an old or unknown check changes nothing.
        """
        host = self.host(host_session_id, sessions)
        if host.checks.answer(read_check) and host.in_flight and host.checks.early is None:
            # Holding requests, it is asked again soon: a host that stops reading is found out quickly.
            host.checks.early = asyncio.get_running_loop().call_later(
                READ_CHECK_AFTER_S, self._early_check, host
            )

    def _deliver(self, pending: PendingRequest, host: HostSession, *, again: bool = False) -> None:
        """Send the request to `host`; sent `again` (its first host left), with the time it has left."""
        pending.host = host
        host.in_flight[pending.request.tool_request_id] = pending
        request = pending.request
        if again:
            left_ms = math.floor(request.timeout_ms - (time.monotonic() - pending.started) * 1000)
            request = replace(request, timeout_ms=max(left_ms, 1))
        if pending.generation and not host.acknowledges_starts:
            # It may start as soon as it is read: its start is marked before it is sent.
            task = asyncio.create_task(self._mark_then_send(pending, host, request))
            self._marking.add(task)
            task.add_done_callback(self._marking.discard)
            return
        self._send(pending, host, request)

    async def _mark_then_send(self, pending: PendingRequest, host: HostSession, request: ToolRequest) -> None:
        verdict = await self._mark([pending])
        if self._pending.get(request.tool_request_id) is not pending or pending.host is not host:
            return  # ended (or its host left) meanwhile: it was never sent
        if verdict[0] is not MarkVerdict.WON:
            self._unfenced(pending, verdict[0], tell_host=False)
            return
        pending.host_started = True
        self._send(pending, host, request)

    async def _mark(self, fenced: Sequence[PendingRequest]) -> list[MarkVerdict | None]:
        """Mark the starts of `fenced` in one step: each one's verdict, None when the fence's store
        could not be reached within MARK_RETRY_S and half the time they have left (then none may
        start), or for one that ended meanwhile.

        Asked again, for those still pending, while the store cannot be reached (a mark whose reply
        was lost may have been made: this process's marker wins it again), and while the ledger
        does not hold an invocation (ABSENT: the invocation service sent its request while its
        claim was on its way; it withdraws a request whose claim made nothing).
        """
        assert self.fence is not None
        now = time.monotonic()
        left_s = min(pending.ends_at for pending in fenced) - now
        give_up = now + min(self._mark_retry_s, left_s / 2)
        (backoff_s, most_s), absent_s = MARK_BACKOFF_S, ABSENT_BACKOFF_S
        verdicts: list[MarkVerdict | None] = [None] * len(fenced)
        todo: Sequence[int] = range(len(fenced))
        while True:
            asked = [
                position
                for position in todo
                if self._pending.get(fenced[position].request.tool_request_id) is fenced[position]
            ]
            if not asked:
                return verdicts
            marks = [self._start_mark(fenced[position]) for position in asked]
            try:
                answers = await self.fence.mark_started(marks)
            except ToolmeshError as error:
                if error.code is not Code.STORE_UNAVAILABLE:
                    raise
                if time.monotonic() + backoff_s > give_up:
                    log.warning("starts not fenced: the ledger is unreachable", extra={"count": len(marks)})
                    return verdicts
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, most_s)
                todo = asked
                continue
            for position, verdict in zip(asked, answers, strict=True):
                verdicts[position] = verdict
            todo = [position for position in asked if verdicts[position] is MarkVerdict.ABSENT]
            if not todo or time.monotonic() + absent_s > give_up:
                return verdicts
            await asyncio.sleep(absent_s)
            absent_s = min(absent_s * 2, most_s)

    def _start_mark(self, pending: PendingRequest) -> StartMark:
        return StartMark(pending.request.tool_request_id, pending.generation, self._marker)

    def _unfenced(self, pending: PendingRequest, verdict: MarkVerdict | None, *, tell_host: bool) -> None:
        """End a request whose start the fence refused (`verdict`; None: the ledger was unreachable):
        it ran nowhere through this replica, and its invocation is sent elsewhere, or ended."""
        why = "store_unavailable" if verdict is None else verdict.value
        if tell_host:
            self._stop(pending, EndReason.CANCELLED)
        else:
            self._end(pending, EndReason.CANCELLED)
        log.info(
            "start refused by the start fence",
            extra={"tool_request_id": pending.request.tool_request_id, "fence": why},
        )
        pending.settle(
            Outcome.runtime_error(
                Code.TOOL_HOST_UNAVAILABLE,
                "It was not started through this bridge replica (see the details' startFence).",
                {"sessionId": pending.request.session_id, START_FENCE: why},
            )
        )

    def _send(self, pending: PendingRequest, host: HostSession, request: ToolRequest) -> None:
        host.send(request)
        checks = host.checks
        pending.after_check = checks.waiting
        if checks.early is None and checks.waiting == 0:
            # Unanswered by then, the request asks whether the host reads at all.
            checks.early = asyncio.get_running_loop().call_later(READ_CHECK_AFTER_S, self._early_check, host)

    def _heartbeat(self, host: HostSession) -> Heartbeat:
        return Heartbeat() if host.checks.waiting else self._read_check(host)

    def _read_check(self, host: HostSession) -> Heartbeat:
        """A heartbeat with a new read check, for `host` to answer."""
        check = next(self._read_checks)
        overdue = asyncio.get_running_loop().call_later(READ_CHECK_TIMEOUT_S, self._overdue, host, check)
        host.checks.sent(check, time.monotonic(), overdue)
        return Heartbeat(check)

    def _early_check(self, host: HostSession) -> None:
        host.checks.early = None
        if not host.closed and host.in_flight and host.checks.waiting == 0:
            host.send(self._read_check(host))

    def _overdue(self, host: HostSession, check: int) -> None:
        host.checks.overdue = None
        if host.closed or host.checks.waiting != check or not host.checks.answered:
            return  # answered meanwhile; or a host that never answers checks: it stays UNKNOWN
        log.warning(
            "host stopped reading its stream; its session ends",
            extra={"session_id": host.session_id, "host_session_id": host.host_session_id},
        )
        host.send(_Close(ToolmeshError(Code.HOST_NOT_READING, "", {"host_session_id": host.host_session_id})))
        self.close_host(host)

    def close_host(self, host: HostSession) -> None:
        if host.closed:
            return
        host.closed = True
        for closed in list(host.on_close):
            closed()
        self._open.give_back(host.grant)
        host.stop_heartbeats()
        host.checks.cancel()
        self._observer.host_closed(host)
        self._hosts.pop(host.host_session_id, None)
        peers = self._by_session.get(host.session_id, [])
        if host in peers:
            peers.remove(host)
        if not peers:
            self._by_session.pop(host.session_id, None)
        for pending in list(host.in_flight.values()):
            host.in_flight.pop(pending.request.tool_request_id, None)
            # A fenced request to a host that does not acknowledge starts is sent (and marked
            # host_started) only once its start is marked: before that, it never reached the host.
            # One whose START is being marked was not told it either (`marking`).
            never_started = not pending.host_started and (host.acknowledges_starts or pending.generation > 0)
            if pending.request.redeliverable or never_started:
                # Safe to run (again): hand it to another host, now or when one connects, whose
                # START (a redeliverable one may have started here) is its own.
                pending.host_started = pending.marking = False
                other = self._pick(host.session_id, pending.request.tool_name)
                log.info(
                    "redelivering after host left",
                    extra={
                        "tool_request_id": pending.request.tool_request_id,
                        "waiting": other is None,
                        "never_started": never_started,
                    },
                )
                if other is not None:
                    self._deliver(pending, other, again=True)
                else:
                    pending.host = None
                    self._waiting.setdefault(host.session_id, []).append(pending)
                continue
            self._end(pending, EndReason.HOST_GONE)
            pending.settle(
                Outcome.runtime_error(
                    Code.TOOL_HOST_DISCONNECTED,
                    "It may have started, and it is not read-only or idempotent, so it was not sent again.",
                    {"toolRequestId": pending.request.tool_request_id},
                )
            )
        log.info(
            "host disconnected",
            extra={"session_id": host.session_id, "host_session_id": host.host_session_id},
        )
        for hook in self.closed_hooks:
            hook(host)

    def shutdown(self) -> None:
        self._shutting_down = True
        for host in list(self._hosts.values()):
            host.send(_CLOSE)

    def _pick(self, session_id: str, tool_name: str) -> HostSession | None:
        """A host of the session with a named handler for the tool, else one with a generic handler.

        None when no host of the session serves the tool.
        """
        hosts = self._by_session.get(session_id)
        if not hosts:
            return None
        now = time.monotonic()

        def rank(host: HostSession) -> tuple[bool, bool, Reading, int]:
            # Able to handle it; then not taken over from; then reading its stream; then a named handler.
            preference = host.preference(tool_name)
            return preference > 0, not host.retiring, host.checks.reading(now), preference

        ranks = [rank(host) for host in hosts]
        best = max(ranks)
        if not best[0]:
            return None  # no host has a handler for it
        candidates = [host for host, host_rank in zip(hosts, ranks, strict=True) if host_rank == best]
        # Least loaded first; rotate among equals so hosts share the work.
        fewest = min(len(host.in_flight) for host in candidates)
        candidates = [host for host in candidates if len(host.in_flight) == fewest]
        return candidates[next(self._turn) % len(candidates)]

    def _end(self, pending: PendingRequest, reason: EndReason) -> None:
        request_id = pending.request.tool_request_id
        self._pending.pop(request_id, None)
        self._deadlines.discard(pending)
        if pending.progress is not None:
            pending.progress.close()
        host = pending.host
        if host is not None:
            host.in_flight.pop(request_id, None)
            if host.retiring and not host.in_flight:
                host.send(_RETIRED)
        else:
            waiting = self._waiting.get(pending.request.session_id, [])
            if pending in waiting:
                waiting.remove(pending)
            if not waiting:
                self._waiting.pop(pending.request.session_id, None)
        self._ended[request_id] = _Ended(host.host_session_id if host is not None else "", reason)
        while len(self._ended) > self._ended_memory:
            self._ended.popitem(last=False)

    def start(self, request: ToolRequest, settle: Settle, on_progress: ProgressSink | None = None) -> None:
        """Send `request` to a host of its session; `settle` gets its outcome, within its timeout.

        `settle` runs on this loop, exactly once, unless the request is cancelled
        first. `on_progress` gets the host's progress reports while it runs, at
        most one per PROGRESS_INTERVAL_MS (see ProgressGate), none after `settle`.
        Raises ToolmeshError(REQUEST_DUPLICATE) for an id seen before.
        """
        request_id = request.tool_request_id
        if request_id in self._pending or request_id in self._ended:
            raise ToolmeshError(Code.REQUEST_DUPLICATE, "", {"toolRequestId": request_id})
        left_ms = time_left_ms(request)
        if left_ms <= 0:
            # Its invocation's deadline passed before this bridge read it (see time_left_ms):
            # its caller hears TOOL_TIMEOUT, so no host may start it.
            settle(Outcome.runtime_error(Code.TOOL_TIMEOUT, "The deadline passed before the bridge read it."))
            return
        host = self._pick(request.session_id, request.tool_name)
        if host is None:
            if self.serves(request.session_id):
                # Hosts are connected, but none has a handler for this tool: nothing ran.
                # The same details as a host SDK gives.
                settle(
                    Outcome.runtime_error(
                        Code.TOOL_HANDLER_NOT_FOUND,
                        "No connected host of the session has a handler for it.",
                        {"tool": request.tool_name},
                    )
                )
            else:
                details = {"sessionId": request.session_id}
                settle(Outcome.runtime_error(Code.TOOL_HOST_UNAVAILABLE, details=details))
            return
        # The deadline on this bridge's clock travels with the request: a host that reads it late
        # counts from it, not from its reading.
        # Hosts get the time left, never the invocation's deadline (another clock's).
        tool_timeout_ms = request.timeout_ms
        generation = request.dispatch_generation
        request = replace(
            request,
            timeout_ms=left_ms,
            deadline_unix_ms=math.floor(time.time() * 1000) + left_ms,
            invocation_deadline_unix_ms=0,
            dispatch_generation=0,
        )
        fenced = self.fence is not None and not request.redeliverable
        pending = PendingRequest(
            request,
            None,
            settle,
            time.monotonic(),
            tool_timeout_ms=tool_timeout_ms,
            generation=generation if fenced else 0,
        )
        if on_progress is not None:
            pending.progress = ProgressGate(on_progress)
        self._pending[request_id] = pending
        log.debug("dispatching", extra={"host_session_id": host.host_session_id})
        self._deliver(pending, host)
        # A deadline rather than a task waiting on the outcome: whichever of
        # the deadline and the host's submit comes first settles it, on this one loop.
        self._deadlines.add(pending, request.timeout_ms / 1000)

    def cancel(self, tool_request_id: str) -> None:
        """Give up on a pending request (its caller left): the host is told to stop it."""
        pending = self._pending.get(tool_request_id)
        if pending is not None:
            self._stop(pending, EndReason.CANCELLED)

    async def dispatch(self, request: ToolRequest) -> Outcome:
        """`start`, awaited: the outcome; cancelling the wait cancels the request."""
        result: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()

        def settle(outcome: Outcome) -> None:
            if not result.done():  # the wait may be cancelled, not yet unwound
                result.set_result(outcome)

        self.start(request, settle)
        try:
            return await result
        except asyncio.CancelledError:
            self.cancel(request.tool_request_id)
            raise

    def _expire(self, pending: PendingRequest) -> None:
        self._stop(pending, EndReason.TIMED_OUT)
        timeout_ms = pending.tool_timeout_ms
        pending.settle(
            Outcome.runtime_error(
                Code.TOOL_TIMEOUT,
                f"No result within {pending.request.timeout_ms} ms.",
                {"timeoutMs": timeout_ms, "waitedMs": round((time.monotonic() - pending.started) * 1000)},
            )
        )

    def _settle_elsewhere(self, pending: PendingRequest, outcome: Outcome) -> None:
        """Settle a request with the outcome of another host session than the one holding it; the
        holder (if it was sent out) is told to stop, as for a cancellation."""
        holder = pending.host
        self._end(pending, EndReason.ANSWERED)
        if holder is not None:
            holder.send(ToolRequestCancelled(pending.request.tool_request_id, EndReason.CANCELLED))
        pending.settle(outcome)

    def _stop(self, pending: PendingRequest, reason: EndReason) -> None:
        """End a request the host has not answered, and tell the host to cancel it."""
        host = pending.host
        self._end(pending, reason)
        if host is not None:
            host.send(ToolRequestCancelled(pending.request.tool_request_id, reason))

    def report_progress(
        self, host_session_id: str, progress: ToolProgress, sessions: Container[str] | None = None
    ) -> tuple[ProgressVerdict, bool]:
        """Pass a host's progress report on to the request's callers; what became of it, and whether
        its message was cut. Only a fault of the host session itself raises: HOST_SESSION_UNKNOWN
        as `host` does, INVALID_REQUEST for a malformed id."""
        host = self.host(host_session_id, sessions)
        tool_request_id = progress.tool_request_id
        require_id(tool_request_id, "tool_request_id")
        pending = self._pending.get(tool_request_id)
        if pending is None or pending.host is not host:
            ended = self._ended.get(tool_request_id)
            if pending is None and ended is not None and ended.host_session_id == host_session_id:
                return ProgressVerdict.REQUEST_ENDED, False
            return ProgressVerdict.REQUEST_UNKNOWN, False
        if not valid_numbers(progress.progress, progress.total):
            return ProgressVerdict.INVALID, False
        message, truncated = capped_message(progress.message)
        pending.host_started = True  # it runs: from now on it is no longer safe to send elsewhere
        if pending.progress is not None:
            pending.progress.offer(replace(progress, message=message or None))
        return ProgressVerdict.ACCEPTED, truncated

    async def start_requests(
        self, host_session_id: str, tool_request_ids: Iterable[str], sessions: Container[str] | None = None
    ) -> list[StartVerdict]:
        """Whether the host may start each request (one verdict per id, in order): START at most once
        per request, to the host session it is pending on, before its deadline by this bridge's clock,
        and, for a fenced request, once its start is marked in the ledger (all of a call's in one
        step): a mark refused ends the request here (CANCELLED; see the module's docstring).

        A request found past its deadline (its timer has not run yet) ends here with TOOL_TIMEOUT.
        Raises ToolmeshError: HOST_SESSION_UNKNOWN as `host` does, INVALID_REQUEST for a malformed
        id or too many of them (then nothing starts).
        """
        host = self.host(host_session_id, sessions)
        ids = list(tool_request_ids)
        if len(ids) > MAX_CALLS_PER_MESSAGE:
            raise ToolmeshError(
                Code.INVALID_REQUEST,
                f"At most {MAX_CALLS_PER_MESSAGE} ids per call.",
                {"limit": str(MAX_CALLS_PER_MESSAGE)},
            )
        for tool_request_id in ids:
            require_id(tool_request_id, "tool_request_ids")
        verdicts = [self._start_one(host, tool_request_id) for tool_request_id in ids]
        fenced = [
            (position, pending)
            for position, verdict in enumerate(verdicts)
            if verdict is StartVerdict.START and (pending := self._pending[ids[position]]).generation
        ]
        if not fenced:
            return verdicts
        marked = await self._mark([pending for _, pending in fenced])
        for (position, pending), mark in zip(fenced, marked, strict=True):
            if self._pending.get(pending.request.tool_request_id) is not pending or pending.host is not host:
                # Ended meanwhile, or its host left before it was told START: sent elsewhere, if anywhere.
                verdicts[position] = self._start_one(host, pending.request.tool_request_id)
                continue
            pending.marking = False
            if mark is not MarkVerdict.WON:
                self._unfenced(pending, mark, tell_host=True)
                verdicts[position] = StartVerdict.CANCELLED
            else:
                pending.host_started = True
        return verdicts

    def _start_one(self, host: HostSession, tool_request_id: str) -> StartVerdict:
        pending = self._pending.get(tool_request_id)
        if pending is None:
            ended = self._ended.get(tool_request_id)
            if ended is None or ended.host_session_id != host.host_session_id:
                return StartVerdict.UNKNOWN
            return _START_AFTER_END[ended.reason]
        if pending.host is not host:
            return StartVerdict.UNKNOWN
        if pending.host_started or pending.marking:
            return StartVerdict.ALREADY_STARTED
        if time.monotonic() >= pending.ends_at:
            self._expire(pending)  # this clock fences the deadline, however late its timer runs
            return StartVerdict.TIMED_OUT
        if pending.generation:
            pending.marking = True  # started once marked (start_requests)
        else:
            pending.host_started = True
        return StartVerdict.START

    def submitting_host(
        self, host_session_id: str, tool_request_id: str, sessions: Container[str] | None = None
    ) -> HostSession:
        """The open host session handing in an outcome for `tool_request_id`; as `host`, with
        both ids in the error's metadata."""
        host = self._hosts.get(host_session_id)
        if host is None or (sessions is not None and host.session_id not in sessions):
            metadata = {"hostSessionId": host_session_id, "toolRequestId": tool_request_id}
            raise ToolmeshError(Code.HOST_SESSION_UNKNOWN, "", metadata)
        return host

    def timed_out(self, tool_request_id: str) -> bool:
        """Whether this replica ended the request lately with TOOL_TIMEOUT."""
        ended = self._ended.get(tool_request_id)
        return ended is not None and ended.reason is EndReason.TIMED_OUT

    def knows(self, tool_request_id: str) -> bool:
        """Whether this replica sent the request (it is pending, or ended lately)."""
        return tool_request_id in self._pending or tool_request_id in self._ended

    def submit(
        self,
        host_session_id: str,
        tool_request_id: str,
        outcome: Outcome,
        sessions: Container[str] | None = None,
    ) -> None:
        """Accept a host's outcome for a pending request, or raise a ToolmeshError saying why not.

        `sessions`: those the submitter may serve (None: all); a host session of
        another is unknown to it. A request that is not this host session's (sent to
        another, or to none) is REQUEST_UNKNOWN either way: the answer says nothing of
        other host sessions' requests. Except a read-only or idempotent request of the
        submitter's own session: any run's outcome is its outcome (see `_settle_elsewhere`).
        """
        metadata = {"hostSessionId": host_session_id, "toolRequestId": tool_request_id}
        host = self.submitting_host(host_session_id, tool_request_id, sessions)
        pending = self._pending.get(tool_request_id)
        if pending is None:
            ended = self._ended.get(tool_request_id)
            if ended is None or ended.host_session_id != host_session_id:
                raise ToolmeshError(Code.REQUEST_UNKNOWN, "", metadata)
            raise ToolmeshError(
                Code.REQUEST_ENDED,
                _ENDED_BECAUSE[ended.reason],
                {**metadata, "ended": ended.reason.value},
            )
        if pending.host is not host:
            if not (pending.request.redeliverable and pending.request.session_id == host.session_id):
                raise ToolmeshError(Code.REQUEST_UNKNOWN, "", metadata)
            # A read-only or idempotent request sent here again after the replica that first
            # delivered it was lost: the host it first went to ran it and hands its result here.
            # That run counts (it may run more than once); the delivery made since is called off.
            check_outcome(outcome, metadata)
            self._settle_elsewhere(pending, outcome)
            return
        check_outcome(outcome, metadata)
        if pending.after_check:
            # The host read this request, so the check sent before it too (the stream is in order).
            host.checks.answer(pending.after_check)
        self._end(pending, EndReason.ANSWERED)
        pending.settle(outcome)
