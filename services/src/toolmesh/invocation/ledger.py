"""The invocation ledger: which logical invocations run or recently ended, and their outcomes.

Keys in the store (all with expiry, so the ledger stays bounded):
- `ledger:inv:<id>`: the invocation record (state, outcome, delivered, times).
- `ledger:same:<session>:<tool>:<arguments digest>`: the dedupe pointer to the
  running or unconfirmed invocation with that logical identity.
- `ledger:idem:<length of session>:<session>:<key>`: an idempotency key and its
  arguments digest. The length prefix keeps pairs apart when ids contain `:`
  (session `a:b` with key `c` is not session `a` with key `b:c`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

from toolmesh.core import jsontext
from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import ErrorKind, Outcome, ToolFailure
from toolmesh.store.base import Store

DECODED_CACHE_SIZE = 4096
# Marks arguments not parsed yet (None is a JSON value).
_UNPARSED: Any = object()


class InvocationState(enum.Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    TIMED_OUT = "timed_out"
    FAILED = "failed"


def state_of(outcome: Outcome) -> InvocationState:
    failure = outcome.failure
    if failure is None or failure.kind is ErrorKind.DOMAIN:
        return InvocationState.COMPLETED
    if failure.code == Code.TOOL_TIMEOUT:
        return InvocationState.TIMED_OUT
    return InvocationState.FAILED


@dataclass(frozen=True, slots=True)
class LedgerPolicy:
    # How long an unconfirmed outcome is replayed to an exact retry.
    replay_window_s: float = 120.0
    # A received TOOL_TIMEOUT ends the invocation; it is replayed only briefly.
    timeout_replay_window_s: float = 15.0
    # How long GetInvocation can find a finished invocation.
    record_retention_s: float = 600.0
    # How long an idempotency key keeps returning the same outcome.
    idempotency_retention_s: float = 24 * 3600.0
    # A running record outlives its deadline by this much at most (a lost owner).
    running_grace_s: float = 30.0


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

    @property
    def finished(self) -> bool:
        return self.state is not InvocationState.RUNNING

    def ended_with(self, outcome: Outcome, at: float) -> InvocationRecord:
        return self._changed(state_of(outcome), outcome, self.delivered, at)

    def delivered_now(self) -> InvocationRecord:
        return self._changed(self.state, self.outcome, True, self.finished_at)

    def _changed(
        self, state: InvocationState, outcome: Outcome | None, delivered: bool, finished_at: float | None
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
            "delivered": record.delivered,
            "finished": record.finished_at,
            "idem": record.idempotency_key,
            "trace": record.trace_context,
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
        delivered=data["delivered"],
        finished_at=data["finished"],
        idempotency_key=data["idem"],
        trace_context=data["trace"],
    )


@dataclass(frozen=True, slots=True)
class Claim:
    """The result of claiming a call: run it anew, or attach to an existing invocation."""

    record: InvocationRecord
    is_new: bool


class Ledger:
    def __init__(
        self, store: Store, policy: LedgerPolicy | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._store = store
        self.policy = policy or LedgerPolicy()
        self._clock = clock
        # Records this process wrote or read recently, by their stored bytes: skips decoding.
        self._decoded: dict[bytes, InvocationRecord] = {}

    def _encode(self, record: InvocationRecord) -> bytes:
        raw = _encode(record)
        self._remember(raw, record)
        return raw

    def _decode(self, raw: bytes) -> InvocationRecord:
        record = self._decoded.get(raw)
        if record is None:
            record = _decode(raw)
            self._remember(raw, record)
        return record

    def _remember(self, raw: bytes, record: InvocationRecord) -> None:
        # Records are immutable: the same bytes always decode to an equal record.
        if len(self._decoded) >= DECODED_CACHE_SIZE:
            self._decoded.clear()
        self._decoded[raw] = record

    @staticmethod
    def _record_key(tool_request_id: str) -> str:
        return f"ledger:inv:{tool_request_id}"

    @staticmethod
    def _identity_key(identity: str) -> str:
        return f"ledger:same:{identity}"

    @staticmethod
    def _idempotency_key(session_id: str, key: str) -> str:
        return f"ledger:idem:{len(session_id)}:{session_id}:{key}"

    async def get(self, tool_request_id: str) -> InvocationRecord | None:
        stored = await self._store.get(self._record_key(tool_request_id))
        return None if stored is None else self._decode(stored.value)

    async def claim(
        self,
        call: ToolCall,
        new_id: str,
        timeout_ms: int,
        idempotency_key: str = "",
        trace_context: dict[str, str] | None = None,
        *,
        arguments: jsontext.JsonValue = _UNPARSED,
    ) -> Claim:
        """Register `call` as invocation `new_id`, unless an identical one should be joined or replayed.

        `arguments`: the call's arguments already parsed, when the caller has them.
        """
        identity = identity_of(call, arguments) or f"{call.session_id}:{call.tool_name}:unique:{new_id}"
        if idempotency_key:
            existing = await self._by_idempotency_key(call, identity, idempotency_key, new_id)
            if existing is not None:
                return Claim(existing, False)
        else:
            existing = await self._attachable(identity)
            if existing is not None:
                return Claim(existing, False)
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
        )
        running_ttl = timeout_ms / 1000 + self.policy.running_grace_s
        await self._store.put(self._record_key(new_id), self._encode(record), ttl_s=running_ttl)
        if idempotency_key:
            return Claim(record, True)
        # Another call may have claimed the identity meanwhile (another replica): theirs wins.
        winner = await self._store.create(self._identity_key(identity), new_id.encode(), ttl_s=running_ttl)
        if winner is not None:
            other = await self.get(winner.value.decode())
            if other is not None and not other.delivered:
                await self._store.delete(self._record_key(new_id))
                return Claim(other, False)
            await self._store.put(self._identity_key(identity), new_id.encode(), ttl_s=running_ttl)
        return Claim(record, True)

    async def _attachable(self, identity: str) -> InvocationRecord | None:
        pointer = await self._store.get(self._identity_key(identity))
        if pointer is None:
            return None
        record = await self.get(pointer.value.decode())
        if record is None or record.delivered:
            return None
        return record

    async def _by_idempotency_key(
        self, call: ToolCall, identity: str, key: str, new_id: str
    ) -> InvocationRecord | None:
        entry = json.dumps({"id": new_id, "identity": identity}).encode()
        existing = await self._store.create(
            self._idempotency_key(call.session_id, key), entry, ttl_s=self.policy.idempotency_retention_s
        )
        if existing is None:
            return None
        claimed = json.loads(existing.value)
        if claimed["identity"] != identity:
            raise ToolmeshError(
                Code.IDEMPOTENCY_KEY_REUSED,
                "",
                {"session_id": call.session_id, "idempotency_key": key, "tool_request_id": claimed["id"]},
            )
        record = await self.get(claimed["id"])
        if record is None:
            # The first call's record expired or never got written: start over under this key.
            await self._store.put(
                self._idempotency_key(call.session_id, key), entry, ttl_s=self.policy.idempotency_retention_s
            )
        return record

    def _ttl(self, record: InvocationRecord) -> float:
        if record.idempotency_key:
            return max(self.policy.record_retention_s, self.policy.idempotency_retention_s)
        return self.policy.record_retention_s

    def _replay_window(self, record: InvocationRecord) -> float:
        if record.state is InvocationState.TIMED_OUT:
            return self.policy.timeout_replay_window_s
        return self.policy.replay_window_s

    async def finish(
        self,
        tool_request_id: str,
        outcome: Outcome,
        *,
        replayable: bool = True,
        claimed: InvocationRecord | None = None,
    ) -> None:
        """Record the outcome. With `replayable`, an exact retry replays it until delivery is confirmed.

        `claimed` is the record `claim` returned, when the caller has it: it
        saves reading it back (only the claimant finishes an invocation).
        """
        record = claimed or await self.get(tool_request_id)
        if record is None:
            return
        finished = record.ended_with(outcome, self._clock())
        await self._store.put(
            self._record_key(tool_request_id), self._encode(finished), ttl_s=self._ttl(finished)
        )
        if finished.idempotency_key:
            return
        if replayable:
            await self._store.put(
                self._identity_key(finished.identity),
                tool_request_id.encode(),
                ttl_s=self._replay_window(finished),
            )
        else:
            await self._drop_pointer(finished)

    async def _drop_pointer(self, record: InvocationRecord) -> None:
        pointer = await self._store.get(self._identity_key(record.identity))
        if pointer is not None and pointer.value.decode() == record.tool_request_id:
            await self._store.delete(self._identity_key(record.identity))

    async def confirm(self, tool_request_id: str, sessions: Container[str] | None = None) -> None:
        """Mark the outcome delivered; nothing for another session than `sessions` (None: all)."""
        record = await self.get(tool_request_id)
        if record is None or record.delivered or (sessions is not None and record.session_id not in sessions):
            return
        if not record.finished:
            raise ToolmeshError(Code.INVOCATION_RUNNING, "", {"tool_request_id": tool_request_id})
        await self._store.put(
            self._record_key(tool_request_id),
            self._encode(record.delivered_now()),
            ttl_s=self._ttl(record),
        )
        await self._drop_pointer(record)

    async def wait_finished(self, tool_request_id: str) -> InvocationRecord | None:
        """Wait until the invocation has ended (it may run in another process); None if it vanished."""
        async for stored in self._store.watch(self._record_key(tool_request_id)):
            if stored is None:
                return None
            record = self._decode(stored.value)
            if record.finished:
                return record
        return None
