"""The invocation service's domain: check a tool call, run it under its deadline."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Container, Coroutine, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

from toolmesh.contracts.cancels import CancelBoard
from toolmesh.contracts.ledger import (
    CANCELLED,
    CancelVerdict,
    Claim,
    InvocationRecord,
    InvocationState,
    Ledger,
    rfc3339,
)
from toolmesh.core import jsontext
from toolmesh.core.calls import ToolCall, ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.limits import CALLER_DEADLINE_SLACK_MS, MAX_ARGUMENTS_BYTES
from toolmesh.core.names import require_id, require_tool_name
from toolmesh.core.outcome import Outcome
from toolmesh.core.progress import ToolProgress
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.early import QUIET_BELOW, EarlyDispatcher, EarlyDispatches
from toolmesh.invocation.ports import (
    Dispatcher,
    InvocationObserver,
    NoInvocationObserver,
    OutcomeElsewhere,
    ProgressSink,
    ToolCatalog,
)
from toolmesh.invocation.progress_relay import ProgressRelay
from toolmesh.invocation.quotas import Lease, Quotas
from toolmesh.invocation.validation import Validation, validate_now
from toolmesh.rules.shares import Shares
from toolmesh.store import slots
from toolmesh.store.ledger import Delivered, LeaseRefused

log = logging.getLogger("toolmesh.invocation")

MAX_CONFIRMATIONS = 1000
# A claim that failed so made nothing: a request sent while it was on its way is withdrawn.
_NOTHING_CLAIMED = frozenset({Code.QUOTA_EXCEEDED, Code.CALLER_DEADLINE_EXCEEDED, Code.RETRY_WINDOW_PASSED})
# Told the id of the invocation a call waits on, of the call's attachment, and until when an exact
# retry surely joins or replays it (unix seconds; see Invoker.invoke).
Announce = Callable[[str, str, float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class InvokeResult:
    """What one call got: the invocation it ran, joined or replayed, and its outcome.

    `tool_request_id` is empty when the call was refused before it became an
    invocation (TOOL_NOT_FOUND, TOOL_ARGS_INVALID): nothing was recorded, so
    there is no id to look up.
    """

    tool_request_id: str
    outcome: Outcome
    # This call joined an identical running invocation, or replayed a finished one.
    joined: bool = False
    replayed: bool = False
    # This call's attachment to the invocation, for its delivery confirmation ("" with no invocation).
    attachment_id: str = ""


def new_tool_request_id(session_id: str) -> str:
    """A new id, carrying its session's slot tag (toolmesh.store.slots: found on a cluster by id alone)."""
    return _id_prefix(session_id) + _RANDOM.uuid4_hex()


@lru_cache(maxsize=4096)
def _id_prefix(session_id: str) -> str:
    """`tr_<tag>_`: the session's slot tag is a digest, the same for each of its calls."""
    return slots.tool_request_id(session_id, "")


class _RandomPool:
    """`uuid.uuid4().hex` from the kernel's random bytes taken 4 KiB at a time.

    The same ids (version 4, random from os.urandom), without a system call and a
    UUID object each: uuid4 cost a call several microseconds. A forked child drops
    the bytes it inherited, so that it mints no id its parent mints.
    """

    _SIZE = 4096

    def __init__(self) -> None:
        self._bytes = b""
        self._at = 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._bytes, self._at = b"", 0

    def uuid4_hex(self) -> str:
        if self._at + 16 > len(self._bytes):
            self._bytes, self._at = os.urandom(self._SIZE), 0
        raw = bytearray(self._bytes[self._at : self._at + 16])
        self._at += 16
        raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
        raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
        return raw.hex()


_RANDOM = _RandomPool()


def check_confirmations(deliveries: Sequence[Delivered]) -> None:
    """Raise ToolmeshError(INVALID_REQUEST) for too many or malformed confirmations."""
    if len(deliveries) > MAX_CONFIRMATIONS:
        raise ToolmeshError(Code.INVALID_REQUEST, f"At most {MAX_CONFIRMATIONS} confirmations per call.")
    for tool_request_id, attachment_id in deliveries:
        require_id(tool_request_id, "tool_request_id")
        if attachment_id:
            require_id(attachment_id, "attachment_id")


def check_envelope(call: ToolCall) -> None:
    """Raise ToolmeshError(INVALID_REQUEST) for a call that cannot even be looked up."""
    require_id(call.session_id, "session_id")
    require_id(call.turn_id, "turn_id")
    require_tool_name(call.tool_name)


def check_arguments(tool: ToolSpec, arguments_json: str) -> Outcome | None:
    """A TOOL_ARGS_INVALID outcome when the arguments are not an object that fits the schema.

    On the calling thread, whatever it costs (benchmarks); the Invoker uses its Validation.
    """
    arguments = parse_arguments(arguments_json)
    if isinstance(arguments, Outcome):
        return arguments
    return validate_now(tool, arguments, arguments_json)


def parse_arguments(arguments_json: str) -> jsontext.JsonValue | Outcome:
    """The arguments' value, or a TOOL_ARGS_INVALID outcome when they are too large or not JSON."""
    if len(arguments_json.encode()) > MAX_ARGUMENTS_BYTES:
        return Outcome.runtime_error(
            Code.TOOL_ARGS_INVALID,
            f"Arguments larger than {MAX_ARGUMENTS_BYTES} bytes.",
            {"reason": "too_large"},
        )
    try:
        return jsontext.parse(arguments_json)
    except jsontext.NotPlainJson as refused:
        # What is validated must be what the host reads: text that readers take differently is refused.
        return Outcome.runtime_error(
            Code.TOOL_ARGS_INVALID,
            f"Arguments are not plain JSON: {refused.problem}.",
            {"reason": "not_json"},
        )


async def _answering(answer: asyncio.Future[Outcome], running: Awaitable[Outcome]) -> Outcome:
    """`running`'s outcome, also handed to `answer` (unless it is done: its caller left)."""
    try:
        outcome = await running
    except asyncio.CancelledError:
        answer.cancel()
        raise
    except Exception as error:
        if not answer.done():
            answer.set_exception(error)
        raise
    if not answer.done():
        answer.set_result(outcome)
    return outcome


class _OutcomeUnread(Exception):
    """The ledger's store failed while a call waited there for an outcome that another process
    may have produced: the call ends with no outcome (OUTCOME_UNAVAILABLE)."""

    def __init__(self, tool_request_id: str) -> None:
        super().__init__(tool_request_id)
        self.tool_request_id = tool_request_id

    def error(self, attachment_id: str) -> ToolmeshError:
        return ToolmeshError(
            Code.OUTCOME_UNAVAILABLE,
            "",
            {"toolRequestId": self.tool_request_id, "attachmentId": attachment_id},
        )


class Invoker:
    """Runs, joins or replays tool calls; tells `observer` what happens (by default, nobody)."""

    def __init__(
        self,
        catalog: ToolCatalog,
        dispatcher: Dispatcher,
        ledger: Ledger,
        max_in_flight: int | None = None,
        *,
        observer: InvocationObserver | None = None,
        validation: Validation | None = None,
        quotas: Quotas | None = None,
        cancels: CancelBoard | None = None,
        progress: ProgressRelay | None = None,
        recorded_elsewhere: CancelBoard | None = None,
        early: EarlyDispatcher | None = None,
    ) -> None:
        """`cancels`: where cancellations go for the replica that runs the invocation, when replicas
        share the ledger (None: this process runs every invocation it records); `progress`: where
        the progress of invocations goes for callers that joined them through another replica;
        `recorded_elsewhere`: where bridge replicas post the outcomes they recorded for requests
        another bridge replica was sent (follow_recorded_elsewhere).
        `max_in_flight`: calls waiting here at once (default: the `calls_in_flight` limit).
        `early`: `dispatcher` again, when it fences the starts of the requests that are not
        read-only nor idempotent in `ledger` (bridge replicas share it): those go while their
        claim is on its way (toolmesh.invocation.early), on a ledger whose claims take a round
        trip and wait for no replica."""
        self._catalog = catalog
        self._dispatcher = dispatcher
        self.ledger = ledger
        self._validation = validation or Validation()
        self._quotas = quotas or Quotas(None)
        self._observer: InvocationObserver = observer or NoInvocationObserver()
        # Calls waiting here: past a grant's share that grant's new ones are refused
        # (QUOTA_EXCEEDED), past the process-wide bound everyone's (OVERLOADED), rather
        # than slowing every call down.
        self._waiting = Shares(
            self._quotas.limits,
            "calls_in_flight",
            "calls_in_flight_per_grant",
            what="calls waiting for their outcome",
            total=max_in_flight,
        )
        self._stopping = False
        # Outcomes of the invocations this process runs, for identical calls to
        # join. They go on when their caller leaves, so that a caller whose own
        # deadline passed can retry and join them.
        self._running: dict[str, asyncio.Future[Outcome]] = {}
        # The task dispatching each invocation this process runs, to stop it when it is cancelled,
        # and those being stopped so.
        self._dispatching: dict[str, asyncio.Task[Any]] = {}
        self._cancelling: set[str] = set()
        self._cancels = cancels
        # Invocations whose outcome another bridge replica recorded while their dispatch waits,
        # stopped so (their outcome is read from the ledger).
        self._recorded_elsewhere = recorded_elsewhere
        self._outcome_recorded: set[str] = set()
        # Callers told of the progress of invocations running here, by tool request id.
        self._listeners: dict[str, list[ProgressSink]] = {}
        self._relay = progress
        self._early: EarlyDispatches | None = None
        if early is not None and not ledger.claims_at_once and not ledger.claims_replicated:
            self._early = EarlyDispatches(early)

    async def invoke(
        self,
        call: ToolCall,
        idempotency_key: str = "",
        confirmed: Sequence[Delivered] = (),
        *,
        leaves_early: bool = True,
        on_invocation: Announce | None = None,
        sessions: Container[str] | None = None,
        caller: str | None = None,
        on_progress: ProgressSink | None = None,
    ) -> InvokeResult:
        """Run, join or replay `call`, after applying the caller's `confirmed` deliveries.

        A caller that may be cancelled before the outcome (`leaves_early`, a
        unary RPC whose client gives up) gets the invocation run in a task of
        its own, which goes on without it. One that always waits for the
        outcome (a call on an InvokeTools stream) runs it itself and saves the task.
        `on_invocation` is awaited with the invocation's id and the call's
        attachment id once the call has them and waits for its outcome (it ran
        anew or joined), so that a caller who gives up still knows what to
        reconcile and which attachment to confirm.
        `sessions`: those the caller may call (None: all); PERMISSION_DENIED for another.
        `caller`: who calls (a token's subject; None: unauthenticated), for the rate per caller.
        `on_progress` gets the progress reports of the invocation while the call
        waits for it (best effort): from the bridge when this process runs it, else
        through the store from the replica that does (with a ProgressRelay).
        """
        check_envelope(call)
        refuse_if_late(call)
        if sessions is not None and call.session_id not in sessions:
            raise ToolmeshError(
                Code.PERMISSION_DENIED,
                "Its sessions do not include this one.",
                {"sessionId": call.session_id},
            )
        if idempotency_key:
            require_id(idempotency_key, "idempotency_key")
        check_confirmations(confirmed)
        if confirmed and sessions is not None:
            # Only the caller's own sessions' deliveries: a read first (the claim then carries them).
            confirmed = await self.ledger.permitted(confirmed, sessions)
        if self._stopping:
            raise ToolmeshError(Code.SHUTTING_DOWN)
        # The caller's grant is its subject: a prefix grant's sessions share one grant's places.
        self._waiting.take(caller)
        try:
            self._quotas.take_call(caller)
            observed = self._observer.call(call)
            with observed:
                result = await self._invoke(
                    call, idempotency_key, leaves_early, confirmed, on_invocation, on_progress=on_progress
                )
                observed.answered(result.tool_request_id, result.outcome)
            return result
        finally:
            self._waiting.give_back(caller)

    async def _invoke(
        self,
        call: ToolCall,
        idempotency_key: str,
        leaves_early: bool,
        confirmed: Sequence[Delivered],
        on_invocation: Announce | None,
        *,
        on_progress: ProgressSink | None = None,
    ) -> InvokeResult:
        """`confirmed`: deliveries the caller confirms with this call. They go with its claim, in
        the same atomic step, so they apply before it; a call that claims nothing applies them alone."""
        tool = await self._catalog.get_tool(call.session_id, call.tool_name)
        if tool is None:
            outcome = Outcome.runtime_error(
                Code.TOOL_NOT_FOUND, details={"sessionId": call.session_id, "tool": call.tool_name}
            )
            await self._confirm(confirmed)
            return InvokeResult("", outcome)
        arguments = parse_arguments(call.arguments_json)
        invalid = (
            arguments
            if isinstance(arguments, Outcome)
            else await self._validation.arguments(tool, arguments, call.arguments_json)
        )
        if invalid is not None:
            await self._confirm(confirmed)
            return InvokeResult("", invalid)
        return await self._invoke_valid(
            call,
            tool,
            arguments=arguments,
            idempotency_key=idempotency_key,
            leaves_early=leaves_early,
            confirmed=confirmed,
            on_invocation=on_invocation,
            on_progress=on_progress,
        )

    async def _invoke_valid(
        self,
        call: ToolCall,
        tool: ToolSpec,
        *,
        arguments: jsontext.JsonValue,
        idempotency_key: str,
        leaves_early: bool,
        confirmed: Sequence[Delivered],
        on_invocation: Announce | None,
        on_progress: ProgressSink | None,
    ) -> InvokeResult:
        tool_request_id = new_tool_request_id(call.session_id)
        request = ToolRequest(
            session_id=call.session_id,
            turn_id=call.turn_id,
            tool_request_id=tool_request_id,
            tool_name=call.tool_name,
            arguments_json=call.arguments_json,
            timeout_ms=tool.effective_timeout_ms,
            redeliverable=tool.annotations.read_only or tool.annotations.idempotent,
            # Every bridge it reaches, however late it reads it, ends it by then.
            invocation_deadline_unix_ms=math.floor(time.time() * 1000) + tool.effective_timeout_ms,
        )
        lease = self._quotas.in_flight(call.session_id, tool.effective_timeout_ms)
        sent_early = self._send_early(call, request, idempotency_key)

        async def claiming() -> Claim:
            # The session's place is taken in the claim's own store step, when it starts a new
            # invocation (its finish gives it back); refused, nothing is claimed.
            refuse_if_late(call)  # again, as the last step before the ledger: a pause may come between
            try:
                return await self.ledger.claim(
                    call,
                    tool_request_id,
                    tool.effective_timeout_ms,
                    idempotency_key,
                    self._observer.trace_context(),
                    arguments=arguments,
                    confirmed=confirmed,
                    lease=lease.terms,
                )
            except LeaseRefused:
                raise lease.refused() from None

        try:
            claim = await self._claim(claiming(), request, tool, leaves_early, lease)
        except BaseException as error:
            # A unary caller that left: the claim goes on, and _claimed_without_caller settles it.
            if sent_early and not (leaves_early and isinstance(error, asyncio.CancelledError)):
                self._claim_failed(request, tool, lease, error)
            raise
        if sent_early:
            self._claim_settled(request.tool_request_id, claim)
        record = claim.record
        safe_until = self.ledger.retry_safe_until(record)
        if on_invocation is not None and record.outcome is None:
            await on_invocation(record.tool_request_id, claim.attachment_id, safe_until)
        if on_progress is None or record.outcome is not None:
            return await self._attach_stating(
                claim, request, tool, leaves_early, lease, safe_until=safe_until
            )
        listeners = self._listeners.setdefault(record.tool_request_id, [])
        listeners.append(on_progress)
        following = None
        if self._relay is not None and not claim.is_new and record.tool_request_id not in self._running:
            # Joined an invocation another replica runs: its progress comes through the store.
            following = asyncio.create_task(self._relay.follow(record.tool_request_id, on_progress))
        try:
            return await self._attach_stating(
                claim, request, tool, leaves_early, lease, safe_until=safe_until
            )
        finally:
            if following is not None:
                following.cancel()
            listeners.remove(on_progress)
            if not listeners:
                self._listeners.pop(record.tool_request_id, None)

    async def _attach_stating(
        self,
        claim: Claim,
        request: ToolRequest,
        tool: ToolSpec,
        leaves_early: bool,
        lease: Lease,
        *,
        safe_until: float,
    ) -> InvokeResult:
        """As `_attach`; a call that ends with no outcome (OUTCOME_UNAVAILABLE) says until when its
        exact retry joins or replays the invocation (`retrySafeUntil`)."""
        try:
            return await self._attach(claim, request, tool, leaves_early, lease)
        except ToolmeshError as error:
            if error.code is Code.OUTCOME_UNAVAILABLE:
                error.metadata.setdefault("retrySafeUntil", rfc3339(safe_until))
            raise

    async def _attach(
        self, claim: Claim, request: ToolRequest, tool: ToolSpec, leaves_early: bool, lease: Lease
    ) -> InvokeResult:
        """The outcome of the claimed invocation: run anew, replayed, or joined.

        A new invocation gives its session's place back when it ends, whoever waits for it;
        a call that replays or joins one took none.
        """
        record = claim.record
        tool_request_id = request.tool_request_id
        attachment_id = claim.attachment_id
        with self._observer.invocation(record.tool_request_id):
            if claim.is_new:
                outcome = await self._start(
                    request, tool, record, leaves_early, attachment_id=attachment_id, lease=lease
                )
                return InvokeResult(tool_request_id, outcome, attachment_id=attachment_id)
            if record.outcome is not None:
                with self._observer.attached(record, "replayed"):
                    log.info("replayed an unconfirmed outcome")
                    return InvokeResult(
                        record.tool_request_id,
                        await self._replayed(record),
                        replayed=True,
                        attachment_id=attachment_id,
                    )
            with self._observer.attached(record, "joined"):
                log.info("joined a running invocation")
                outcome = await self._outcome_of(
                    record.tool_request_id, tool.effective_timeout_ms, attachment_id
                )
                return InvokeResult(record.tool_request_id, outcome, joined=True, attachment_id=attachment_id)

    async def _replayed(self, record: InvocationRecord) -> Outcome:
        """The outcome an exact retry replays: the record's, or, for one that timed out, the outcome
        its host handed in late, if one was kept (read again: a claim's reply does not carry it)."""
        assert record.outcome is not None
        if record.state is not InvocationState.TIMED_OUT:
            return record.outcome
        try:
            again = await self.ledger.get(record.tool_request_id)
        except ToolmeshError as error:
            if error.code is not Code.STORE_UNAVAILABLE:
                raise
            return record.outcome
        late = None if again is None else again.late_outcome
        return record.outcome if late is None else late

    async def _claim(
        self,
        claiming: Coroutine[Any, Any, Claim],
        request: ToolRequest,
        tool: ToolSpec,
        leaves_early: bool,
        lease: Lease,
    ) -> Claim:
        """The ledger's claim. One whose caller may leave (a unary RPC) goes on without it: a claim
        that made a new invocation must run it, or exact retries would join one that nobody runs.
        A claim that never suspends (the store in memory) cannot be left half made: it needs no
        task of its own, which would cost the call three more turns of the event loop."""
        if not leaves_early or self.ledger.claims_at_once:
            return await claiming
        task = asyncio.ensure_future(claiming)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(partial(self._claimed_without_caller, request, tool, lease))
            raise

    def _claimed_without_caller(
        self, request: ToolRequest, tool: ToolSpec, lease: Lease, claiming: asyncio.Future[Claim]
    ) -> None:
        sent_early = self._early is not None and self._early.task(request.tool_request_id) is not None
        failure = asyncio.CancelledError() if claiming.cancelled() else claiming.exception()
        if failure is not None:
            if sent_early:
                self._claim_failed(request, tool, lease, failure)
            return  # nothing claimed, no place taken
        claim = claiming.result()
        if sent_early:
            self._claim_settled(request.tool_request_id, claim)
        if claim.is_new:  # a join or replay took no place: nothing to give back
            self._run_detached(request, tool, claim.record, lease)

    def _send_early(self, call: ToolCall, request: ToolRequest, idempotency_key: str) -> bool:
        """Send the request of the invocation a claim may make while the claim is on its way
        (toolmesh.invocation.early), when its start is fenced and it is not likely to join or
        replay another: whether it was sent."""
        early = self._early
        if early is None or request.redeliverable or idempotency_key or early.running(call):
            return False
        if len(self._dispatching) + len(early) >= QUIET_BELOW:
            return False
        early.send(call, request, self._progress_sink(request))
        return True

    def _claim_settled(self, tool_request_id: str, claim: Claim) -> None:
        """The claim of a request sent early came back: it goes on as the new invocation, or is
        withdrawn when the call joined or replays another."""
        assert self._early is not None
        if claim.is_new:
            self._early.claimed(tool_request_id)
        else:
            self._early.withdraw(tool_request_id)

    def _claim_failed(self, request: ToolRequest, tool: ToolSpec, lease: Lease, error: BaseException) -> None:
        """The claim of a request sent early failed: withdrawn when nothing was claimed for sure;
        else the claim may have made the invocation, whose outcome is finished when it comes."""
        assert self._early is not None
        if isinstance(error, ToolmeshError) and error.code in _NOTHING_CLAIMED:
            self._early.withdraw(request.tool_request_id)
            return
        self._early.unknown(request.tool_request_id)
        self._run_detached(request, tool, None, lease)

    def _run_detached(
        self,
        request: ToolRequest,
        tool: ToolSpec,
        claimed: InvocationRecord | None,
        lease: Lease,
        answer: asyncio.Future[Outcome] | None = None,
    ) -> asyncio.Task[Outcome]:
        """Run a new invocation in a task of its own, which goes on whoever waits for it.

        `answer` gets its outcome (or error) from within the task, unless it is done by then (its
        caller left: cancelled): as a shield would, one turn of the event loop sooner.
        """
        running = self._run_and_give_back(request, tool, claimed, lease)
        task = asyncio.create_task(running if answer is None else _answering(answer, running))
        self._running[request.tool_request_id] = task
        task.add_done_callback(partial(self._ended, request.tool_request_id))
        return task

    async def _start(
        self,
        request: ToolRequest,
        tool: ToolSpec,
        claimed: InvocationRecord,
        leaves_early: bool,
        *,
        attachment_id: str,
        lease: Lease,
    ) -> Outcome:
        """Run a new invocation; identical calls meanwhile wait on it in `_running`."""
        tool_request_id = request.tool_request_id
        try:
            if leaves_early:
                answer: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
                self._run_detached(request, tool, claimed, lease, answer)
                return await answer
        except _OutcomeUnread as unread:
            raise unread.error(attachment_id) from None
        ran: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._running[tool_request_id] = ran
        try:
            outcome = await self._run_and_give_back(request, tool, claimed, lease)
        except asyncio.CancelledError:
            ran.cancel()
            raise
        except _OutcomeUnread as unread:
            ran.set_exception(unread)
            ran.exception()  # marked as seen: its joiners, if any, get it too
            raise unread.error(attachment_id) from None
        except Exception as error:
            ran.set_exception(error)
            ran.exception()  # marked as seen: its joiners, if any, get it too
            raise
        else:
            ran.set_result(outcome)
            return outcome
        finally:
            self._running.pop(tool_request_id, None)

    def _ended(self, tool_request_id: str, task: asyncio.Task[Outcome]) -> None:
        self._running.pop(tool_request_id, None)
        if not task.cancelled():
            task.exception()  # marked as seen: its caller, if any, got it through its answer

    async def _run_and_give_back(
        self, request: ToolRequest, tool: ToolSpec, claimed: InvocationRecord | None, lease: Lease
    ) -> Outcome:
        try:
            return await self._run(request, tool, claimed)
        except BaseException:
            # It may end without the ledger's finish (which gives the place back): give it back here.
            if lease.terms is not None:
                await self.ledger.release_lease(lease.terms, request.tool_request_id)
            raise

    async def _run(self, request: ToolRequest, tool: ToolSpec, claimed: InvocationRecord | None) -> Outcome:
        with self._observer.executing(request) as executing:
            outcome = await self._dispatch_and_finish(request, tool, claimed)
            executing.ran(outcome)
            return outcome

    async def _dispatch_and_finish(
        self, request: ToolRequest, tool: ToolSpec, claimed: InvocationRecord | None
    ) -> Outcome:
        """`claimed`: the claim's record (None: the claim's fate is unknown, the record is read)."""
        self._observer.in_flight(1)
        tool_request_id = request.tool_request_id
        dispatching = asyncio.current_task()
        if dispatching is not None:
            self._dispatching[tool_request_id] = dispatching
        try:
            early = None if self._early is None else self._early.take(tool_request_id)
            running = early or self._dispatcher.dispatch(request, self._progress_sink(request))
            outcome = await running
        except asyncio.CancelledError:
            if dispatching is None:
                raise
            if tool_request_id in self._outcome_recorded:
                # The host handed its result to another bridge replica, which recorded it.
                self._outcome_recorded.discard(tool_request_id)
                dispatching.uncancel()
                self._dispatching.pop(tool_request_id, None)  # a cancellation now is in the ledger alone
                log.info("outcome recorded by another bridge replica: read from the ledger")
                return await self._from_ledger(tool_request_id, request.timeout_ms)
            if tool_request_id not in self._cancelling:
                raise
            # Cancelled (cancel_invocation): the ledger has TOOL_CANCELLED; the dispatcher told the host.
            self._cancelling.discard(tool_request_id)
            dispatching.uncancel()
            return CANCELLED
        except OutcomeElsewhere:
            # The bridge replica it went to died: the host hands its outcome to another one.
            self._dispatching.pop(tool_request_id, None)  # a cancellation now is in the ledger alone
            log.warning("bridge lost mid-call: waiting for the outcome in the ledger")
            return await self._from_ledger(request.tool_request_id, request.timeout_ms)
        except ToolmeshError as error:
            # The bridge could not be reached: record why; an exact retry runs anew (not replayable).
            await self.ledger.finish(
                request.tool_request_id, Outcome.runtime_error(error.code), claimed=claimed
            )
            raise
        finally:
            self._dispatching.pop(tool_request_id, None)
            self._observer.in_flight(-1)
        outcome = await self._validation.result(tool, outcome)
        # Cancelled as the host answered, or the host's result taken by another bridge replica
        # while the one dispatched through was frozen (this one timed out): the ledger's outcome
        # is everyone's.
        return await self.ledger.finish_first(request.tool_request_id, outcome, claimed=claimed)

    def _progress_sink(self, request: ToolRequest) -> ProgressSink:
        return self._progressed if self._relay is None else partial(self._relayed, request)

    def _relayed(self, request: ToolRequest, progress: ToolProgress) -> None:
        """To this replica's callers, and through the store to other replicas' (kept no longer
        than the request may run)."""
        self._progressed(progress)
        if self._relay is not None:
            self._relay.publish(progress, request.timeout_ms / 1000)

    def _progressed(self, progress: ToolProgress) -> None:
        for listener in self._listeners.get(progress.tool_request_id, ()):
            try:
                listener(progress)
            except Exception as exc:  # one caller's failure is not the invocation's
                log.warning("a progress listener failed", extra={"error": type(exc).__name__})

    async def cancel_invocation(
        self, tool_request_id: str, sessions: Container[str] | None = None
    ) -> CancelVerdict:
        """End a running invocation with TOOL_CANCELLED and stop its host, unless a call joined it
        (JOINED) or it has ended (ENDED). INVOCATION_NOT_FOUND as `get_invocation`; STORE_UNAVAILABLE.

        The ledger records it first, so every caller waiting on it gets TOOL_CANCELLED; then the
        process running it is told: this one at once, another one through the store.
        """
        record = await self.get_invocation(tool_request_id, sessions)
        if record.finished:
            return CancelVerdict.ENDED
        verdict = await self.ledger.cancel(record)
        if verdict is None:
            raise ToolmeshError(Code.INVOCATION_NOT_FOUND, "", {"toolRequestId": tool_request_id})
        if verdict is CancelVerdict.CANCELLED:
            log.info("invocation cancelled", extra={"tool_request_id": tool_request_id})
            if not self.stop_running(tool_request_id) and self._cancels is not None:
                try:
                    await self._cancels.post(tool_request_id)
                except ToolmeshError as error:
                    # Recorded all the same: its caller gets TOOL_CANCELLED once its host answers or
                    # its deadline passes; only the host is not told to stop early.
                    log.warning(
                        "a cancellation was not posted to the other replicas",
                        extra={"tool_request_id": tool_request_id, "code": error.code.value},
                    )
        return verdict

    def stop_running(self, tool_request_id: str) -> bool:
        """Stop dispatching an invocation this process runs (it was cancelled); whether it runs here."""
        dispatching = self._dispatching.get(tool_request_id) or self._sent_early(tool_request_id)
        if dispatching is None or tool_request_id in self._cancelling:
            return dispatching is not None
        self._cancelling.add(tool_request_id)
        dispatching.cancel()
        return True

    def outcome_recorded(self, tool_request_id: str) -> None:
        """A bridge replica recorded the outcome of `tool_request_id` in the ledger, though this
        process dispatched it through another one (frozen, or lost): stop waiting for that one,
        and answer with the ledger's outcome. Nothing for an invocation not dispatched here."""
        dispatching = self._dispatching.get(tool_request_id) or self._sent_early(tool_request_id)
        if dispatching is None or tool_request_id in self._cancelling | self._outcome_recorded:
            return
        self._outcome_recorded.add(tool_request_id)
        dispatching.cancel()

    def _sent_early(self, tool_request_id: str) -> asyncio.Task[Outcome] | None:
        """The dispatch of a request sent while its claim was on its way, until its run awaits it."""
        return None if self._early is None else self._early.task(tool_request_id)

    async def follow_recorded_elsewhere(self, ready: asyncio.Event | None = None) -> None:
        """Call `outcome_recorded` for each outcome bridge replicas post, until cancelled; `ready`
        as for follow_cancellations."""
        if self._recorded_elsewhere is not None:
            await self._recorded_elsewhere.follow(self.outcome_recorded, ready)
        elif ready is not None:
            ready.set()

    async def follow_cancellations(self, ready: asyncio.Event | None = None) -> None:
        """Stop the invocations this process runs when another replica cancels them; until cancelled.

        `ready` is set once cancellations posted from then on are heard.
        """
        if self._cancels is not None:
            await self._cancels.follow(self.stop_running, ready)
        elif ready is not None:
            ready.set()

    async def _outcome_of(self, tool_request_id: str, timeout_ms: int, attachment_id: str) -> Outcome:
        """The outcome of a running invocation: from this process's task when it runs it, else
        from the ledger, within its deadline and a grace."""
        task = self._running.get(tool_request_id)
        try:
            if task is not None:
                return await asyncio.shield(task)
            # Running in another process: wait for the ledger to say it ended.
            return await self._from_ledger(tool_request_id, timeout_ms)
        except _OutcomeUnread as unread:
            raise unread.error(attachment_id) from None

    async def _from_ledger(self, tool_request_id: str, timeout_ms: int) -> Outcome:
        """The outcome another process records in the ledger. Raises _OutcomeUnread when the
        ledger's store fails meanwhile: the tool may have run, so STORE_UNAVAILABLE (which says
        that nothing ran) would be false."""
        try:
            record = await self.ledger.outcome_from_owner(tool_request_id, timeout_ms)
        except ToolmeshError as error:
            if error.code is not Code.STORE_UNAVAILABLE:
                raise
            raise _OutcomeUnread(tool_request_id) from None
        if record is None or record.outcome is None:
            raise ToolmeshError(
                Code.INVOCATION_NOT_FOUND, "It vanished while joined.", {"toolRequestId": tool_request_id}
            )
        return record.outcome

    async def confirm_delivery(
        self, deliveries: Sequence[Delivered], sessions: Container[str] | None = None
    ) -> None:
        """Confirm deliveries of outcomes; unknown, expired or running invocations are left as they
        are, and so are those of sessions other than `sessions` (None: all).

        Raises ToolmeshError(STORE_UNAVAILABLE) when the ledger's store cannot be reached.
        """
        check_confirmations(deliveries)
        await self._confirm(await self.ledger.permitted(deliveries, sessions))

    async def _confirm(self, deliveries: Sequence[Delivered]) -> None:
        if deliveries:
            # Those still running have nothing to confirm yet: the ledger leaves them as they are.
            await self.ledger.confirm_all(deliveries)

    async def get_invocation(
        self, tool_request_id: str, sessions: Container[str] | None = None
    ) -> InvocationRecord:
        """The ledger's record; INVOCATION_NOT_FOUND when unknown or of a session not in `sessions`."""
        require_id(tool_request_id, "tool_request_id")
        record = await self.ledger.get(tool_request_id)
        if record is None or (sessions is not None and record.session_id not in sessions):
            raise ToolmeshError(Code.INVOCATION_NOT_FOUND, "", {"toolRequestId": tool_request_id})
        return record

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Refuse new calls (SHUTTING_DOWN); give running ones up to `timeout_s` to finish."""
        self._stopping = True
        if self._running:
            await asyncio.wait(set(self._running.values()), timeout=timeout_s)


def refuse_if_late(call: ToolCall) -> None:
    """Raise CALLER_DEADLINE_EXCEEDED for a call read past its caller's own deadline (and the slack):
    its caller gave up and may have retried, so it must not become an invocation (nothing runs)."""
    now_ms = math.floor(time.time() * 1000)
    if call.deadline_unix_ms and now_ms > call.deadline_unix_ms + CALLER_DEADLINE_SLACK_MS:
        raise ToolmeshError(
            Code.CALLER_DEADLINE_EXCEEDED,
            f"It was read {now_ms - call.deadline_unix_ms} ms after its caller's deadline by the service's "
            "clock; nothing ran (a caller whose clock runs behind gets this too: keep clocks in sync).",
            {"deadlineUnixMs": str(call.deadline_unix_ms), "serviceTimeUnixMs": str(now_ms)},
        )
