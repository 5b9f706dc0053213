"""The bridge's copy of a host's outcome in the shared ledger (OutcomeRecorder.record): written a
while after the outcome, and only over an invocation still running, so that the usual call (whose
invocation replica finished it as it answered) costs the copy one read and no write."""

from __future__ import annotations

from typing import Any

import pytest

from toolmesh.bridge.outcomes import OutcomeRecorder, accept
from toolmesh.bridge.router import HostSession, Router
from toolmesh.contracts.ledger import Claim, Ledger
from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.store.memory import MemoryLedgerStore
from toolmesh_testing import eventually

pytestmark = pytest.mark.unit


class CountingStore(MemoryLedgerStore):
    """A memory ledger store that counts the finishes written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.finishes = 0

    async def finish(self, *args: Any) -> str:
        self.finishes += 1
        return await super().finish(*args)


async def outcome_of(ledger: Ledger, tool_request_id: str) -> Outcome | None:
    record = await ledger.get(tool_request_id)
    return record.outcome if record is not None and record.finished else None


async def claimed_with_a_recorder(
    copy_after_s: float,
) -> tuple[CountingStore, Ledger, Claim, OutcomeRecorder]:
    """A ledger on a counting store with invocation tr_1 running, and a recorder writing copies in it."""
    store = CountingStore()
    ledger = Ledger(store)
    claimed = await ledger.claim(ToolCall("s", "turn", "t", '{"a": 1}'), "tr_1", 10_000)
    return store, ledger, claimed, OutcomeRecorder(ledger, copy_after_s=copy_after_s)


async def test_the_copy_finishes_an_invocation_still_running_after_its_delay() -> None:
    store, ledger, _, recorder = await claimed_with_a_recorder(0.2)
    recorder.record("tr_1", Outcome.success("from the host"))
    assert store.finishes == 0  # not yet: the invocation replica's own finish goes first
    assert await eventually(lambda: outcome_of(ledger, "tr_1")) == Outcome.success("from the host")
    assert store.finishes == 1
    await recorder.aclose()


async def test_the_copy_writes_nothing_over_an_invocation_its_replica_finished() -> None:
    store, ledger, claimed, recorder = await claimed_with_a_recorder(60)
    recorder.record("tr_1", Outcome.success("copy"))
    assert await ledger.finish("tr_1", Outcome.success("own"), claimed=claimed.record)
    # Closing writes the waiting copy at once: it reads the record, finished, and writes nothing.
    await recorder.aclose()
    assert store.finishes == 1
    assert await outcome_of(ledger, "tr_1") == Outcome.success("own")


async def test_closing_writes_the_copies_still_waiting() -> None:
    _, ledger, _, recorder = await claimed_with_a_recorder(60)
    recorder.record("tr_1", Outcome.success("copy"))
    await recorder.aclose()
    assert await outcome_of(ledger, "tr_1") == Outcome.success("copy")


async def test_the_copy_of_an_invocation_no_longer_stored_writes_nothing() -> None:
    store = CountingStore()
    ledger = Ledger(store)
    recorder = OutcomeRecorder(ledger, copy_after_s=0)
    recorder.record("tr_gone", Outcome.success("copy"))
    await recorder.aclose()
    assert store.finishes == 0
    assert await ledger.get("tr_gone") is None


async def test_a_late_outcome_is_kept_for_a_host_of_the_session_only() -> None:
    """A result handed in after the invocation timed out (through a replica that did not send it)
    is kept beside the timeout for its own session's host; another session's host is told nothing
    of it, as for any request it was not sent."""
    _, ledger, claimed, recorder = await claimed_with_a_recorder(60)
    await ledger.finish("tr_1", Outcome.runtime_error(Code.TOOL_TIMEOUT), claimed=claimed.record)
    stranger = HostSession("hs_2", "other", "host", frozenset({"t"}), False)
    with pytest.raises(ToolmeshError) as refused:
        await recorder.adopt(stranger, "tr_1", Outcome.success('"forged"'))
    assert refused.value.code is Code.REQUEST_UNKNOWN
    own = HostSession("hs_1", "s", "host", frozenset({"t"}), False)
    await recorder.adopt(own, "tr_1", Outcome.success('"late"'))
    await recorder.adopt(own, "tr_1", Outcome.success('"late"'))  # sent again after a lost answer
    with pytest.raises(ToolmeshError) as refused:
        await recorder.adopt(own, "tr_1", Outcome.success('"another"'))
    assert refused.value.code is Code.REQUEST_ENDED
    record = await ledger.get("tr_1")
    assert record is not None and record.late_outcome == Outcome.success('"late"')
    await recorder.aclose()


async def copy_refusal(
    router: Router, recorder: OutcomeRecorder | None, host_session_id: str, sessions: set[str] | None
) -> Code:
    with pytest.raises(ToolmeshError) as refused:
        await accept(router, recorder, host_session_id, "tr_1", Outcome.success('"copy"'), sessions=sessions)
    return refused.value.code


async def test_a_copy_from_a_host_of_another_replica_is_recorded_for_its_session_only() -> None:
    """A host whose own replica left its result unanswered hands a copy to this one, naming its
    host session there (toolmesh.host.copies): recorded while the invocation runs, for a caller
    that may serve its session; anyone else hears what any unknown host session hears."""
    _, ledger, _, recorder = await claimed_with_a_recorder(60)
    router = Router(heartbeat_s=60)
    assert await copy_refusal(router, None, "hs_elsewhere", None) is Code.HOST_SESSION_UNKNOWN
    assert await copy_refusal(router, recorder, "hs_elsewhere", {"other"}) is Code.HOST_SESSION_UNKNOWN
    # A host session held here answers as its own, though the ledger would take the copy.
    held = router.open_host("other", "host", ["t"], False)
    assert await copy_refusal(router, recorder, held.host_session_id, {"s", "other"}) is Code.REQUEST_UNKNOWN
    assert await outcome_of(ledger, "tr_1") is None
    await accept(router, recorder, "hs_elsewhere", "tr_1", Outcome.success('"copy"'), sessions={"s"})
    assert await outcome_of(ledger, "tr_1") == Outcome.success('"copy"')
    # Sent again (its answer lost), or its own replica's copy: the same outcome, already there.
    with pytest.raises(ToolmeshError) as refused:
        await accept(router, recorder, "hs_elsewhere", "tr_1", Outcome.success('"copy"'), sessions=None)
    assert (refused.value.code, refused.value.metadata["ended"]) == (Code.REQUEST_ENDED, "answered")
    assert await copy_refusal(router, recorder, "hs_elsewhere", {"s"}) is Code.REQUEST_ENDED
    with pytest.raises(ToolmeshError) as refused:
        await accept(router, recorder, "hs_elsewhere", "tr_gone", Outcome.success('"copy"'), sessions=None)
    assert refused.value.code is Code.HOST_SESSION_UNKNOWN
    router.close_host(held)
    await recorder.aclose()
