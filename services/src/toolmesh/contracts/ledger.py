"""The invocation ledger: which logical invocations run or recently ended, and their outcomes.

It keeps its records through a LedgerStore (toolmesh.store.ledger), one
atomic step per stage of a call (claim, finish, confirm), with expiry on
everything so the ledger stays bounded. What it stores per invocation: the
record (state, outcome, times), the pointer from the call's logical identity
(session, tool, canonical arguments) to the running or unconfirmed
invocation, and an idempotency key's claim. An idempotency key is scoped to
its session as `<length of session>:<session>:<key>`: the length keeps pairs
apart when ids contain `:` (session `a:b` with key `c` is not session `a`
with key `b:c`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import hashlib
import json
import logging
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from toolmesh.core import jsontext
from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import ERROR_TABLE, Code, ToolmeshError, code_for_reason
from toolmesh.core.outcome import ErrorKind, Outcome, ToolFailure
from toolmesh.store.ledger import (
    FIRST_ATTACHMENT,
    ClaimNotReplicated,
    Delivered,
    KeyReused,
    LeaseTerms,
    LedgerStore,
    MarkVerdict,
    StartMark,
    StoredInvocation,
)

log = logging.getLogger("toolmesh.invocation")

DECODED_CACHE_SIZE = 4096
# A finish the store could not take is tried again after this long, doubling up to the cap.
RETRY_FIRST_S = 0.05
RETRY_CAP_S = 2.0
# finish_first's second look at a record whose finish failed on an unreachable store: no longer
# than this, so that a store that stopped answering delays its caller's answer by no more.
SECOND_LOOK_S = 0.5
# Marks arguments not parsed yet (None is a JSON value).
_UNPARSED: Any = object()


class InvocationState(enum.Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    TIMED_OUT = "timed_out"
    FAILED = "failed"
    CANCELLED = "cancelled"


class CancelVerdict(enum.Enum):
    """What a cancellation did: ended the invocation, or nothing (it had ended, or a call joined it)."""

    CANCELLED = "cancelled"
    ENDED = "ended"
    JOINED = "joined"


def replayable(outcome: Outcome) -> bool:
    """Whether an exact retry (or a retry with the same idempotency key) may be given `outcome` again.

    Not a runtime error the table marks retryable (BRIDGE_UNAVAILABLE,
    TOOL_HOST_UNAVAILABLE, OVERLOADED, ...): it says "try again", and a replay
    would answer every retry with it until the window ends.
    """
    failure = outcome.failure
    if failure is None or failure.kind is ErrorKind.DOMAIN:
        return True
    code = code_for_reason(failure.code)
    return code is None or not ERROR_TABLE[code].retryable


def state_of(outcome: Outcome) -> InvocationState:
    failure = outcome.failure
    if failure is None or failure.kind is ErrorKind.DOMAIN:
        return InvocationState.COMPLETED
    if failure.code == Code.TOOL_TIMEOUT:
        return InvocationState.TIMED_OUT
    if failure.code == Code.TOOL_CANCELLED:
        return InvocationState.CANCELLED
    return InvocationState.FAILED


# The outcome of a cancelled invocation: replayed to an exact retry like any other (not retryable).
CANCELLED = Outcome.runtime_error(Code.TOOL_CANCELLED, "It was cancelled by a caller.")
# Why a claim no replica confirmed (durable claims) is refused; it never ran.
NOT_REPLICATED = "No replica of the state store confirmed the claim in time."


@dataclass(frozen=True, slots=True)
class LedgerPolicy:
    # How long an unconfirmed outcome is replayed to an exact retry (Limits.replay_window_s).
    replay_window_s: float = 600.0
    # The same for a TOOL_TIMEOUT (the side effect may have happened): no shorter, so that an
    # agent's retry budget never runs it again unseen (Limits.timeout_replay_window_s).
    timeout_replay_window_s: float = 600.0
    # After its replay window, an exact retry of an unconfirmed invocation is still recognised for
    # this long and refused with RETRY_WINDOW_PASSED (nothing runs), rather than run again
    # unseen (Limits.late_retry_notice_s). Past it, the ledger has forgotten the identity.
    late_retry_notice_s: float = 1800.0
    # How long GetInvocation can find a finished invocation.
    record_retention_s: float = 600.0
    # How long an idempotency key keeps returning the same outcome.
    idempotency_retention_s: float = 24 * 3600.0
    # A running record outlives its deadline by at least this much, should its owner be lost (see
    # `orphan_kept_s`).
    running_grace_s: float = 30.0
    # A call waiting on a record another process should finish gives up this long after the
    # deadline and finishes it with TOOL_TIMEOUT: its owner was lost. Below running_grace_s,
    # so that the record is still there to finish.
    owner_grace_s: float = 5.0


@dataclass(frozen=True, slots=True)
class InvocationRecord:
    tool_request_id: str
    session_id: str
    turn_id: str
    tool_name: str
    identity: str
    state: InvocationState
    created_at: float
    outcome: Outcome | None = None
    delivered: bool = False
    finished_at: float | None = None
    idempotency_key: str = ""
    # W3C trace context of the first call, so joined and replayed calls can link to it.
    trace_context: dict[str, str] = field(default_factory=dict)
    # The claimant's replay windows (LedgerPolicy's replay_window_s, timeout_replay_window_s,
    # late_retry_notice_s): whichever process finishes the invocation (a bridge replica may)
    # applies them. Records written before the notice was kept hold the first two only.
    replay_windows: tuple[float, ...] | None = None
    # When a host was allowed to start it (Unix seconds; kept beside the record by the store's
    # start fence, see `Ledger.mark_started`); None: no start marked (not started, or started by
    # a host that does not acknowledge starts, or through a bridge without the shared ledger).
    started_at: float | None = None
    # The outcome its host handed in after it had ended with TOOL_TIMEOUT (kept beside the record
    # by `Ledger.keep_late`), and when (Unix seconds): what the handler did, for reconciling.
    late_outcome: Outcome | None = None
    late_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.state is not InvocationState.RUNNING

    def ended_with(self, outcome: Outcome, at: float) -> InvocationRecord:
        return self._changed(state_of(outcome), outcome, self.delivered, at)

    def delivered_now(self) -> InvocationRecord:
        return self._changed(self.state, self.outcome, True, self.finished_at)

    def started_then(self, at: float) -> InvocationRecord:
        return self._changed(self.state, self.outcome, self.delivered, self.finished_at, at)

    def late_then(self, outcome: Outcome, at: float) -> InvocationRecord:
        # Rare (a timed-out record read back): replace's cost does not matter here.
        return replace(self, late_outcome=outcome, late_at=at)

    def _changed(
        self,
        state: InvocationState,
        outcome: Outcome | None,
        delivered: bool,
        finished_at: float | None,
        started_at: float | None = None,
    ) -> InvocationRecord:
        """A copy with the fields that change after the claim: positional, as dataclasses.replace
        costs several times more, twice per call."""
        return InvocationRecord(
            self.tool_request_id,
            self.session_id,
            self.turn_id,
            self.tool_name,
            self.identity,
            state,
            self.created_at,
            outcome,
            delivered,
            finished_at,
            self.idempotency_key,
            self.trace_context,
            self.replay_windows,
            self.started_at if started_at is None else started_at,
            self.late_outcome,
            self.late_at,
        )


def identity_of(call: ToolCall, arguments: jsontext.JsonValue = _UNPARSED) -> str | None:
    """The logical identity of a call: session, tool and canonical arguments. None when not JSON.

    `arguments`: the call's arguments already parsed, when the caller has them.
    """
    try:
        parsed = jsontext.parse(call.arguments_json) if arguments is _UNPARSED else arguments
        canonical = jsontext.canonical(parsed)
    except (jsontext.NotPlainJson, ValueError):
        return None
    digest = hashlib.sha256(canonical).hexdigest()
    return f"{call.session_id}:{call.tool_name}:{digest}"


def rfc3339(at: float) -> str:
    """Unix seconds as an RFC 3339 UTC time, to the millisecond (as ErrorInfo metadata and JSON give it)."""
    return (
        datetime.datetime.fromtimestamp(at, datetime.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def _outcome_record(outcome: Outcome) -> dict[str, Any]:
    if outcome.failure is None:
        return {"result": outcome.result_json}
    failure = outcome.failure
    return {
        "error": [failure.kind.value, failure.code, failure.message, failure.details, failure.retryable],
    }


def _outcome_from(record: dict[str, Any]) -> Outcome:
    if "result" in record:
        return Outcome.success(record["result"])
    kind, code, message, details, retryable = record["error"]
    return Outcome.error(ToolFailure(ErrorKind(kind), code, message, details, retryable))


# Built once: json.dumps with options builds a new encoder on every call.
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def _encode(record: InvocationRecord) -> bytes:
    """The record's bytes; whether its delivery was confirmed is kept by the store beside them."""
    return _COMPACT.encode(
        {
            "id": record.tool_request_id,
            "session": record.session_id,
            "turn": record.turn_id,
            "tool": record.tool_name,
            "identity": record.identity,
            "state": record.state.value,
            "created": record.created_at,
            "outcome": None if record.outcome is None else _outcome_record(record.outcome),
            "finished": record.finished_at,
            "idem": record.idempotency_key,
            "trace": record.trace_context,
            "windows": record.replay_windows,
        },
    ).encode()


def _decode(raw: bytes) -> InvocationRecord:
    data = json.loads(raw)
    return InvocationRecord(
        tool_request_id=data["id"],
        session_id=data["session"],
        turn_id=data["turn"],
        tool_name=data["tool"],
        identity=data["identity"],
        state=InvocationState(data["state"]),
        created_at=data["created"],
        outcome=None if data["outcome"] is None else _outcome_from(data["outcome"]),
        finished_at=data["finished"],
        idempotency_key=data["idem"],
        trace_context=data["trace"],
        replay_windows=None if data.get("windows") is None else tuple(data["windows"]),
    )


# The store's finish arguments for an invocation ending (Ledger._finished).
FinishWrite = tuple[bytes, str, float, float | None]


@dataclass(frozen=True, slots=True)
class _Unread:
    """An outcome kept for an invocation whose record could not be read (the store was out): the
    record is read once the store is back, and finished then, if still running."""

    outcome: Outcome
    at: float


@dataclass(frozen=True, slots=True)
class Claim:
    """The result of claiming a call: run it anew, or attach to an existing invocation."""

    record: InvocationRecord
    is_new: bool
    # This call's attachment to the invocation, for its delivery confirmation.
    attachment_id: str = FIRST_ATTACHMENT


class Ledger:
    def __init__(
        self, store: LedgerStore, policy: LedgerPolicy | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._store = store
        self.policy = policy or LedgerPolicy()
        self._clock = clock
        # Records this process wrote or read recently, by their stored bytes: skips decoding.
        self._decoded: dict[bytes, InvocationRecord] = {}
        # Finishes the store could not take (it was unreachable), by tool request id, tried
        # again until it takes them: an outcome, once known, is never lost to an outage. An
        # _Unread one had no record to finish yet (finish without `claimed`, the store out).
        self._unrecorded: dict[str, FinishWrite | _Unread] = {}
        self._recorder: asyncio.Task[None] | None = None

    @property
    def claims_at_once(self) -> bool:
        """Whether `claim` completes without suspending (LedgerStore.synchronous): a cancellation of
        its caller then cannot leave a claim half made."""
        return self._store.synchronous

    @property
    def claims_replicated(self) -> bool:
        """Whether a claim may wait for a replica to have it (durable claims): one stored on the
        primary and not confirmed is then ended as not run."""
        return self._store.claims_replicated

    def _encode(self, record: InvocationRecord) -> bytes:
        raw = _encode(record)
        self._remember(raw, record)
        return raw

    def _decode(self, stored: StoredInvocation) -> InvocationRecord:
        record = self._decoded.get(stored.record)
        if record is None:
            record = _decode(stored.record)
            self._remember(stored.record, record)
        if stored.delivered:
            record = record.delivered_now()
        if stored.started_at_ms:
            record = record.started_then(stored.started_at_ms / 1000)
        if stored.late:
            late = json.loads(stored.late)
            record = record.late_then(_outcome_from(late["outcome"]), late["at"])
        return record

    def _remember(self, raw: bytes, record: InvocationRecord) -> None:
        # Records are immutable: the same bytes always decode to an equal record.
        if len(self._decoded) >= DECODED_CACHE_SIZE:
            self._decoded.clear()
        self._decoded[raw] = record

    async def get(self, tool_request_id: str) -> InvocationRecord | None:
        stored = await self._store.get(tool_request_id)
        return None if stored is None else self._decode(stored)

    async def claim(
        self,
        call: ToolCall,
        new_id: str,
        timeout_ms: int,
        idempotency_key: str = "",
        trace_context: dict[str, str] | None = None,
        *,
        arguments: jsontext.JsonValue = _UNPARSED,
        confirmed: Sequence[Delivered] = (),
        lease: LeaseTerms | None = None,
    ) -> Claim:
        """Register `call` as invocation `new_id`, unless an identical one should be joined or replayed.

        `arguments`: the call's arguments already parsed, when the caller has them.
        `confirmed`: deliveries to confirm first, in the same atomic step (as confirm_all).
        `lease`: taken in the same step when the call starts a new invocation (its finish gives it
        back); LeaseRefused when it cannot be (nothing was claimed).
        Raises ToolmeshError: IDEMPOTENCY_KEY_REUSED, or STORE_UNAVAILABLE (nothing was claimed, or,
        with durable claims, no replica confirmed the claim: nothing runs it).
        """
        identity = identity_of(call, arguments) or f"{call.session_id}:{call.tool_name}:unique:{new_id}"
        record = InvocationRecord(
            tool_request_id=new_id,
            session_id=call.session_id,
            turn_id=call.turn_id,
            tool_name=call.tool_name,
            identity=identity,
            state=InvocationState.RUNNING,
            created_at=self._clock(),
            idempotency_key=idempotency_key,
            trace_context=trace_context or {},
            replay_windows=(
                self.policy.replay_window_s,
                self.policy.timeout_replay_window_s,
                self.policy.late_retry_notice_s,
            ),
        )
        running_ttl = timeout_ms / 1000 + self.orphan_kept_s()
        if idempotency_key:
            try:
                existing = await self._store.claim_keyed(
                    new_id,
                    self._encode(record),
                    f"{len(call.session_id)}:{call.session_id}:{idempotency_key}",
                    identity,
                    running_ttl_s=running_ttl,
                    key_ttl_s=self.policy.idempotency_retention_s,
                    confirmed=confirmed,
                    lease=lease,
                )
            except KeyReused as reused:
                raise ToolmeshError(
                    Code.IDEMPOTENCY_KEY_REUSED,
                    "",
                    {
                        "sessionId": call.session_id,
                        "idempotencyKey": idempotency_key,
                        "toolRequestId": reused.tool_request_id,
                    },
                ) from None
            except ClaimNotReplicated as unconfirmed:
                raise await self._not_replicated(record, unconfirmed) from None
        else:
            try:
                existing = await self._store.claim(
                    new_id, self._encode(record), identity, running_ttl, confirmed=confirmed, lease=lease
                )
            except ClaimNotReplicated as unconfirmed:
                raise await self._not_replicated(record, unconfirmed) from None
        if existing is None:
            return Claim(record, True)
        attached = self._decode(existing)
        if not attached.idempotency_key and self._window_passed(attached):
            raise self._too_late(attached)
        return Claim(attached, False, existing.attachment_id)

    async def _not_replicated(
        self, record: InvocationRecord, unconfirmed: ClaimNotReplicated
    ) -> ToolmeshError:
        """The refusal of a claim no replica confirmed. A new invocation it stored is ended first, with
        a retryable outcome (so not replayed): nothing runs it, the exact retry claims anew, and a
        call that joined it meanwhile is told to retry."""
        if unconfirmed.stored is None:
            failure = Outcome.runtime_error(Code.STORE_UNAVAILABLE, NOT_REPLICATED)
            await self.finish(record.tool_request_id, failure, claimed=record)
        return ToolmeshError(Code.STORE_UNAVAILABLE, NOT_REPLICATED)

    def orphan_kept_s(self) -> float:
        """How long a running record and its identity pointer outlive the deadline, should the
        owner be lost before finishing it (nobody waiting on it then finishes it either): as long as
        an exact retry within its replay window (and the late-retry notice) may come, which then
        joins it and ends it TOOL_TIMEOUT (owner lost), rather than finding nothing and running
        the tool again; and at least `running_grace_s`."""
        policy = self.policy
        kept = policy.owner_grace_s + policy.timeout_replay_window_s + policy.late_retry_notice_s
        return max(policy.running_grace_s, kept)

    def _window_passed(self, record: InvocationRecord) -> bool:
        """Whether `record` finished more than its replay window ago (its pointer is kept longer,
        for late_retry_notice_s, so that a late exact retry is told rather than run)."""
        if record.finished_at is None or not record.finished:
            return False
        return self._clock() > record.finished_at + self._replay_window(record)

    def _too_late(self, record: InvocationRecord) -> ToolmeshError:
        window = self._replay_window(record)
        finished_at = record.finished_at or record.created_at
        return ToolmeshError(
            Code.RETRY_WINDOW_PASSED,
            f"Invocation {record.tool_request_id} ended ({record.state.value}) more than {window:g} s ago.",
            {
                "toolRequestId": record.tool_request_id,
                "state": record.state.value,
                "retrySafeUntil": rfc3339(finished_at + window),
                "replayWindowS": f"{window:g}",
            },
        )

    def retry_safe_until(self, record: InvocationRecord, attached_at: float | None = None) -> float:
        """Until when an exact retry of a call attached to `record` (at `attached_at`, default now)
        surely joins or replays it: it finishes after the attachment, and is replayed for its
        shorter window from its end. Unix seconds."""
        windows = record.replay_windows or (self.policy.replay_window_s, self.policy.timeout_replay_window_s)
        at = self._clock() if attached_at is None else attached_at
        return at + min(windows[0], windows[1])

    def _ttl(self, record: InvocationRecord) -> float:
        if record.idempotency_key:
            return max(self.policy.record_retention_s, self.policy.idempotency_retention_s)
        return self.policy.record_retention_s

    def _replay_window(self, record: InvocationRecord) -> float:
        """The claimant's window (records from before it was kept in them: this ledger's)."""
        windows = record.replay_windows or (self.policy.replay_window_s, self.policy.timeout_replay_window_s)
        return windows[1] if record.state is InvocationState.TIMED_OUT else windows[0]

    def _pointer_kept(self, record: InvocationRecord) -> float:
        """How long the identity pointer of the finished `record` is kept: its replay window, then
        the late-retry notice (the claimant's, as the window)."""
        windows = record.replay_windows or ()
        notice = windows[2] if len(windows) > 2 else self.policy.late_retry_notice_s
        return self._replay_window(record) + notice

    async def finish(
        self,
        tool_request_id: str,
        outcome: Outcome,
        *,
        claimed: InvocationRecord | None = None,
    ) -> bool:
        """Record the outcome. An exact retry replays it until delivery is confirmed, if `replayable`.

        `claimed` is the record `claim` returned, when the caller has it: it
        saves reading it back (only the claimant finishes an invocation). When
        the store cannot be reached (to read the record or to write it) the
        outcome is kept here and written as soon as it can be, as conditionally
        (the first writer wins): this never raises STORE_UNAVAILABLE.

        Returns False when a cancellation had ended the invocation first: its outcome is
        TOOL_CANCELLED, not `outcome` (the caller should give that); True otherwise.
        """
        return await self._finish(tool_request_id, outcome, claimed) != "cancelled"

    async def finish_first(
        self, tool_request_id: str, outcome: Outcome, *, claimed: InvocationRecord | None
    ) -> Outcome:
        """Finish as `finish` does; the invocation's outcome as it stands: `outcome`, or the one
        another writer recorded first (a bridge replica that took the host's result after the one
        this process dispatched through went quiet; TOOL_CANCELLED after a cancellation).

        Reads the record only when the write of a failure lost, or failed on an unreachable store
        (kept for later): the failure may have met a connection that a restart of the store broke,
        which the read connects again, and another writer (the bridge replica the host's result
        came through) may have recorded the result meanwhile. That read waits SECOND_LOOK_S at
        most; an outage then leaves `outcome`. A result that lost was written first by the bridge
        replica it came through (the same outcome, the usual race on every call): no read for it.
        """
        verdict = await self._finish(tool_request_id, outcome, claimed)
        if verdict == "cancelled":
            return CANCELLED
        if verdict not in ("ended", "kept") or outcome.failure is None:
            return outcome
        try:
            async with asyncio.timeout(SECOND_LOOK_S):
                record = await self.get(tool_request_id)
        except TimeoutError:
            return outcome
        except ToolmeshError as error:
            if error.code is not Code.STORE_UNAVAILABLE:
                raise
            return outcome
        return record.outcome if record is not None and record.outcome is not None else outcome

    async def _finish(self, tool_request_id: str, outcome: Outcome, claimed: InvocationRecord | None) -> str:
        """`finish`'s work: the store's verdict ("wrote", "cancelled", "ended"), or "kept" when the
        store was out (written later), or "gone" when the record is not stored."""
        record = claimed
        if record is None:
            try:
                record = await self.get(tool_request_id)
            except ToolmeshError as error:
                if error.code is not Code.STORE_UNAVAILABLE:
                    raise
                # Read and finished later, conditionally as now: a finished record stays as it is.
                self._keep(tool_request_id, _Unread(outcome, self._clock()))
                return "kept"
        if record is None:
            return "gone"
        write = self._finished(record, outcome)
        try:
            return await self._store.finish(tool_request_id, *write)
        except ToolmeshError as error:
            if error.code is not Code.STORE_UNAVAILABLE:
                raise
            self._keep(tool_request_id, write)
            return "kept"

    def _keep(self, tool_request_id: str, kept: FinishWrite | _Unread) -> None:
        """Write `kept` once the store is back (the first outcome kept for an invocation wins)."""
        log.warning("outcome kept until the store is back", extra={"tool_request_id": tool_request_id})
        self._unrecorded.setdefault(tool_request_id, kept)
        if self._recorder is None or self._recorder.done():
            self._recorder = asyncio.create_task(self._record_later())

    def _finished(self, record: InvocationRecord, outcome: Outcome, at: float | None = None) -> FinishWrite:
        """The arguments of the store's finish for `record` ending with `outcome` (at `at`: now)."""
        finished = record.ended_with(outcome, self._clock() if at is None else at)
        return (
            self._encode(finished),
            "" if finished.idempotency_key else finished.identity,
            self._ttl(finished),
            # A keyed invocation has no pointer: None still tells the store its key must not replay it.
            self._pointer_kept(finished) if replayable(outcome) else None,
        )

    async def _record_later(self) -> None:
        pause = RETRY_FIRST_S
        given_up_at = time.monotonic() + self.policy.record_retention_s
        while self._unrecorded and time.monotonic() < given_up_at:
            await asyncio.sleep(pause)
            for tool_request_id, kept in list(self._unrecorded.items()):
                try:
                    await self._write_kept(tool_request_id, kept)
                except ToolmeshError as error:
                    if error.code is Code.STORE_UNAVAILABLE:
                        pause = min(pause * 2, RETRY_CAP_S)
                        break
                    log.error("a kept outcome was refused", extra={"tool_request_id": tool_request_id})
                del self._unrecorded[tool_request_id]
        if self._unrecorded:
            log.error("outcomes lost: the store stayed unreachable", extra={"count": len(self._unrecorded)})
            self._unrecorded.clear()

    async def _write_kept(self, tool_request_id: str, kept: FinishWrite | _Unread) -> None:
        if isinstance(kept, _Unread):
            record = await self.get(tool_request_id)
            if record is None or record.finished:
                return  # gone, or finished by another writer (whose outcome wins)
            kept = self._finished(record, kept.outcome, kept.at)
        await self._store.finish(tool_request_id, *kept)

    async def keep_late(self, record: InvocationRecord, outcome: Outcome) -> bool:
        """Keep `outcome`, which a host handed in after the invocation `record` had ended with
        TOOL_TIMEOUT, beside it (as long as the record), for GetInvocation and exact retries: the
        first kept stays. False, keeping nothing, when `record` did not time out, or is gone or has
        one kept already. Raises ToolmeshError(STORE_UNAVAILABLE)."""
        if record.state is not InvocationState.TIMED_OUT:
            return False
        late = _COMPACT.encode({"outcome": _outcome_record(outcome), "at": self._clock()}).encode()
        return await self._store.keep_late(record.tool_request_id, late)

    async def mark_started(self, marks: Sequence[StartMark]) -> list[MarkVerdict]:
        """The start fence's bridge side: mark each invocation started by the delivery of its
        generation, before a host is allowed to start it (LedgerStore.mark_started): WON lets it
        start; LOST (another delivery started, or the invocation was sent elsewhere since) and
        ENDED do not. Raises ToolmeshError(STORE_UNAVAILABLE): then nothing may start."""
        if not marks:
            return []
        return await self._store.mark_started(marks)

    async def redispatch(self, tool_request_id: str, generation: int) -> int:
        """The start fence's invocation side: the next dispatch generation, when the delivery of
        `generation` never started (then no host can start it any more), else 0: it may have
        started, or it ended (LedgerStore.redispatch). Raises ToolmeshError(STORE_UNAVAILABLE)."""
        return await self._store.redispatch(tool_request_id, generation)

    async def cancel(self, record: InvocationRecord) -> CancelVerdict | None:
        """End the running invocation `record` with TOOL_CANCELLED, unless a call joined it or it has
        ended: one atomic step, so a call that joins meanwhile either sees TOOL_CANCELLED or keeps it
        running. None when it is no longer stored. Raises ToolmeshError(STORE_UNAVAILABLE)."""
        finished = record.ended_with(CANCELLED, self._clock())
        answer = await self._store.cancel(
            record.tool_request_id,
            self._encode(finished),
            "" if finished.idempotency_key else finished.identity,
            self._ttl(finished),
            self._pointer_kept(finished),
        )
        return None if answer is None else CancelVerdict(answer)

    async def release_lease(self, lease: LeaseTerms, tool_request_id: str) -> None:
        """Give back the lease of an invocation that ends without a finish (its caller left first).

        Never raises: a place the store could not take back lapses at its ttl.
        """
        with contextlib.suppress(ToolmeshError):
            await self._store.release_lease(lease.key, tool_request_id)

    async def confirm(
        self, tool_request_id: str, sessions: Container[str] | None = None, attachment_id: str = ""
    ) -> None:
        """Confirm the delivery of the outcome to attachment `attachment_id` ("": to every one);
        nothing when unknown, expired, or of another session than `sessions` (None: all).

        Raises ToolmeshError(INVOCATION_RUNNING) when it has no outcome yet.
        """
        delivered = [Delivered(tool_request_id, attachment_id)]
        if await self.confirm_all(await self.permitted(delivered, sessions)):
            raise ToolmeshError(Code.INVOCATION_RUNNING, "", {"toolRequestId": tool_request_id})

    async def confirm_all(self, deliveries: Sequence[Delivered]) -> list[str]:
        """Confirm these deliveries, in one step; return the ids still running (left as they are)."""
        return await self._store.confirm(deliveries)

    async def permitted(
        self, deliveries: Sequence[Delivered], sessions: Container[str] | None
    ) -> Sequence[Delivered]:
        """Those of `deliveries` whose invocation is of one of `sessions` (None: all, unread)."""
        if sessions is None or not deliveries:
            return deliveries
        # Read together: on Redis, one round trip for all of them.
        records = await asyncio.gather(*(self.get(delivered.tool_request_id) for delivered in deliveries))
        return [
            delivered
            for delivered, record in zip(deliveries, records, strict=True)
            if record is not None and record.session_id in sessions
        ]

    async def wait_finished(
        self, tool_request_id: str, timeout_s: float | None = None
    ) -> InvocationRecord | None:
        """Wait until the invocation has ended (it may run in another process); None if it vanished.

        After `timeout_s` (None: no limit), the record as last read, still running.
        """
        seen: InvocationRecord | None = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                async with contextlib.aclosing(self._store.watch(tool_request_id)) as watched:
                    async for stored in watched:
                        if stored is None:
                            return None
                        seen = self._decode(stored)
                        if seen.finished:
                            return seen
        return seen

    async def outcome_from_owner(self, tool_request_id: str, timeout_ms: int) -> InvocationRecord | None:
        """The record once another process (an invocation or bridge replica) finished it; None if it
        vanished. Past its deadline plus `owner_grace_s` (and `owner_grace_s` after this call
        began to wait) its owner is lost: it is finished here with TOOL_TIMEOUT (unless someone
        finished it first, whose outcome wins).

        Raises ToolmeshError(STORE_UNAVAILABLE) when the store cannot be read; then
        nothing is presumed lost (the owner may hold an outcome the store could not take).
        """
        record = await self.get(tool_request_id)
        if record is None or record.finished:
            return record
        # The grace counts from the deadline, or from now for a call that joins later: the owner
        # may hold an outcome it could not write yet (the store was out) and be about to.
        deadline = record.created_at + timeout_ms / 1000
        give_up_at = max(deadline, self._clock()) + self.policy.owner_grace_s
        waited = await self.wait_finished(tool_request_id, give_up_at - self._clock())
        if waited is not None and waited.finished:
            return waited
        # Read once more (the wait may have seen nothing): an outage must not pass for a lost owner.
        record = await self.get(tool_request_id)
        if record is None or record.finished:
            return record
        log.warning("owner lost: the call ends as timed out", extra={"tool_request_id": tool_request_id})
        lost = Outcome.runtime_error(
            Code.TOOL_TIMEOUT,
            f"No outcome within {timeout_ms} ms: the process that ran it was lost.",
            {"timeoutMs": timeout_ms, "ownerLost": True},
        )
        # Written now or not at all (never kept for later, unlike an outcome a host produced).
        await self._store.finish(tool_request_id, *self._finished(record, lost))
        return await self.get(tool_request_id)

    async def aclose(self) -> None:
        """Stop trying to write kept outcomes (the process is stopping)."""
        if self._recorder is not None:
            self._recorder.cancel()
