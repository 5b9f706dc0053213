"""The ledger through a store outage: an outcome once known is kept and written when the store is
back, also when the record it finishes could not be read (a bridge replica recording a host's
outcome has no claimed record), and never over a record another writer finished meanwhile."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from toolmesh.bridge.outcomes import OutcomeRecorder
from toolmesh.bridge.router import HostSession
from toolmesh.contracts.cancels import RECORDED_KEY, CancelBoard
from toolmesh.contracts.ledger import SECOND_LOOK_S, InvocationState, Ledger
from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import ERROR_TABLE, Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.store.ledger import StoredInvocation
from toolmesh.store.memory import InMemoryStore, MemoryLedgerStore
from toolmesh_testing import eventually, logged

pytestmark = pytest.mark.unit


class OutageStore(MemoryLedgerStore):
    """A memory ledger store whose reads, or writes of finishes, fail as an unreachable store's do."""

    def __init__(self) -> None:
        super().__init__()
        self.reads_down = False
        self.writes_down = False
        self.finishes = 0

    async def get(self, tool_request_id: str) -> StoredInvocation | None:
        if self.reads_down:
            raise ToolmeshError(Code.STORE_UNAVAILABLE)
        return await super().get(tool_request_id)

    async def finish(self, *args: Any) -> str:
        if self.writes_down:
            raise ToolmeshError(Code.STORE_UNAVAILABLE)
        self.finishes += 1
        return await super().finish(*args)

    def down(self, is_down: bool) -> None:
        self.reads_down = self.writes_down = is_down


def call() -> ToolCall:
    return ToolCall("s", "turn", "t", '{"a": 1}')


async def finished_with(ledger: Ledger, tool_request_id: str) -> Outcome | None:
    record = await ledger.get(tool_request_id)
    return record.outcome if record is not None and record.finished else None


async def test_an_outcome_whose_record_cannot_be_read_is_kept_and_written_once_the_store_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = OutageStore()
    ledger = Ledger(store)
    await ledger.claim(call(), "tr_1", 10_000)
    store.down(True)
    # No claimed record: finish must read it, and cannot. It neither raises nor drops the outcome.
    assert await ledger.finish("tr_1", Outcome.success("1")) is True
    assert logged(caplog.records, "outcome kept until the store is back") == 1
    store.down(False)
    assert await eventually(lambda: finished_with(ledger, "tr_1")) == Outcome.success("1")
    record = await ledger.get("tr_1")
    assert record is not None and record.state is InvocationState.COMPLETED
    # An exact retry replays it.
    replay = await ledger.claim(call(), "tr_2", 10_000)
    assert not replay.is_new and replay.record.outcome == Outcome.success("1")
    await ledger.aclose()


async def test_a_kept_outcome_never_overwrites_a_record_finished_meanwhile() -> None:
    store = OutageStore()
    ledger = Ledger(store)
    claimed = await ledger.claim(call(), "tr_1", 10_000)
    store.reads_down = True
    await ledger.finish("tr_1", Outcome.success("bridge"))  # kept, unread
    # Another writer (the invocation replica, with its claimed record) finishes it first.
    await Ledger(store).finish("tr_1", Outcome.success("owner"), claimed=claimed.record)
    store.reads_down = False
    await eventually(lambda: not ledger._unrecorded)
    assert await finished_with(ledger, "tr_1") == Outcome.success("owner")
    assert store.finishes == 1  # read, seen finished: not even tried
    await ledger.aclose()


async def test_a_kept_outcome_of_an_invocation_not_stored_makes_none() -> None:
    store = OutageStore()
    ledger = Ledger(store)
    store.down(True)
    await ledger.finish("tr_never_claimed", Outcome.success("1"))
    store.down(False)
    await eventually(lambda: not ledger._unrecorded)
    assert await ledger.get("tr_never_claimed") is None
    await ledger.aclose()


async def test_the_first_outcome_kept_wins() -> None:
    store = OutageStore()
    ledger = Ledger(store)
    await ledger.claim(call(), "tr_1", 10_000)
    store.down(True)
    await ledger.finish("tr_1", Outcome.success("first"))
    await ledger.finish("tr_1", Outcome.success("second"))
    store.down(False)
    assert await eventually(lambda: finished_with(ledger, "tr_1")) == Outcome.success("first")
    await ledger.aclose()


async def test_a_kept_outcome_waits_through_a_long_outage() -> None:
    store = OutageStore()
    ledger = Ledger(store)
    await ledger.claim(call(), "tr_1", 10_000)
    store.down(True)
    await ledger.finish("tr_1", Outcome.success("1"))
    await eventually(lambda: ledger._recorder is not None, timeout=1)
    # Several retries fail (reads, then writes), and none loses it.
    store.writes_down = False
    await asyncio.sleep(0.4)
    store.reads_down, store.writes_down = False, True
    await asyncio.sleep(0.4)
    assert store.finishes == 0 and "tr_1" in ledger._unrecorded
    store.writes_down = False
    assert await eventually(lambda: finished_with(ledger, "tr_1")) == Outcome.success("1")
    await ledger.aclose()


async def test_the_bridge_s_recorder_keeps_a_host_s_outcome_through_an_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = OutageStore()
    ledger = Ledger(store)
    await ledger.claim(call(), "tr_1", 10_000)
    recorder = OutcomeRecorder(ledger)
    store.down(True)
    with caplog.at_level(logging.INFO):
        recorder.record("tr_1", Outcome.success("1"))
        await eventually(lambda: ledger._unrecorded)
        store.down(False)
        assert await eventually(lambda: finished_with(ledger, "tr_1")) == Outcome.success("1")
    assert logged(caplog.records, "outcome not recorded") == 0
    await recorder.aclose()


async def test_adopting_during_an_outage_is_refused_with_a_retryable_code_then_taken() -> None:
    store = OutageStore()
    ledger = Ledger(store)
    await ledger.claim(call(), "tr_1", 10_000)
    recorder = OutcomeRecorder(ledger)
    host = HostSession("hs_1", "s", "host", frozenset({"t"}), False)
    store.down(True)
    # The record (whose session it checks) cannot be read: the host is told to try again.
    with pytest.raises(ToolmeshError) as refused:
        await recorder.adopt(host, "tr_1", Outcome.success("1"))
    assert ERROR_TABLE[refused.value.code].retryable
    store.down(False)
    await recorder.adopt(host, "tr_1", Outcome.success("1"))
    assert await finished_with(ledger, "tr_1") == Outcome.success("1")
    await recorder.aclose()


async def test_finish_first_keeps_its_own_outcome_when_the_record_cannot_be_read_after_losing() -> None:
    store = OutageStore()
    ledger = Ledger(store)
    claimed = await ledger.claim(call(), "tr_1", 10_000)
    await ledger.finish("tr_1", Outcome.success("1"))
    store.reads_down = True
    timed_out = Outcome.runtime_error(Code.TOOL_TIMEOUT)
    # The write lost (another writer finished it); the read of the winner fails: nothing better known.
    assert await ledger.finish_first("tr_1", timed_out, claimed=claimed.record) == timed_out
    store.reads_down = False
    assert await finished_with(ledger, "tr_1") == Outcome.success("1")
    await ledger.aclose()


class BrokenOnceStore(OutageStore):
    """Its next finish fails as on a connection a restart of the store broke; the next command
    connects again."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False

    async def finish(self, *args: Any) -> str:
        if self.broken:
            self.broken = False
            raise ToolmeshError(Code.STORE_UNAVAILABLE)
        return await super().finish(*args)


async def test_finish_first_gives_the_result_another_writer_recorded_when_its_own_write_failed() -> None:
    """An invocation replica paused across a restart of the store: its timeout's write fails on the
    broken connection, while the bridge replica the host's result came through recorded it."""
    store = BrokenOnceStore()
    ledger = Ledger(store)
    claimed = await ledger.claim(call(), "tr_1", 10_000)
    await ledger.finish("tr_1", Outcome.success("1"))  # the bridge replica's copy
    store.broken = True
    timed_out = Outcome.runtime_error(Code.TOOL_TIMEOUT)
    assert await ledger.finish_first("tr_1", timed_out, claimed=claimed.record) == Outcome.success("1")
    assert await eventually(lambda: not ledger._unrecorded)  # the kept timeout lost, as it should
    assert await finished_with(ledger, "tr_1") == Outcome.success("1")
    await ledger.aclose()


class PausedReadsStore(BrokenOnceStore):
    """Its reads wait until released: a store paused (SIGSTOP) rather than gone."""

    def __init__(self) -> None:
        super().__init__()
        self.released = asyncio.Event()

    async def get(self, tool_request_id: str) -> StoredInvocation | None:
        await self.released.wait()
        return await super().get(tool_request_id)


async def test_finish_first_waits_for_a_paused_store_no_longer_than_its_second_look() -> None:
    store = PausedReadsStore()
    ledger = Ledger(store)
    claimed = await ledger.claim(call(), "tr_1", 10_000)
    store.broken = True
    timed_out = Outcome.runtime_error(Code.TOOL_TIMEOUT)
    finishing = asyncio.ensure_future(ledger.finish_first("tr_1", timed_out, claimed=claimed.record))
    done, _ = await asyncio.wait({finishing}, timeout=SECOND_LOOK_S * 4)
    assert done and finishing.result() == timed_out
    store.released.set()
    # Kept, and written once the store answers again.
    assert await eventually(lambda: finished_with(ledger, "tr_1")) == timed_out
    await ledger.aclose()


class DownStore(InMemoryStore):
    """A store whose every write fails as an unreachable one's does."""

    async def put(self, *args: Any, **kwargs: Any) -> Any:
        raise ToolmeshError(Code.STORE_UNAVAILABLE)


async def test_an_adopted_outcome_is_posted_for_the_invocation_replica_and_a_failed_post_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ledger = Ledger(MemoryLedgerStore())
    host = HostSession("hs_1", "s", "host", frozenset({"t"}), False)
    store = InMemoryStore()
    posted: list[str] = []
    ready = asyncio.Event()
    following = asyncio.create_task(CancelBoard(store, RECORDED_KEY).follow(posted.append, ready))
    await ready.wait()
    await ledger.claim(call(), "tr_1", 10_000)
    recorder = OutcomeRecorder(ledger, recorded_elsewhere=CancelBoard(store, RECORDED_KEY))
    await recorder.adopt(host, "tr_1", Outcome.success("1"))
    assert await eventually(lambda: posted) == ["tr_1"]
    # A post the store refuses: the outcome is recorded all the same, and the failure logged.
    await ledger.claim(ToolCall("s", "turn", "t", '{"a": 2}'), "tr_2", 10_000)
    failing = OutcomeRecorder(ledger, recorded_elsewhere=CancelBoard(DownStore(), RECORDED_KEY))
    with caplog.at_level(logging.WARNING):
        await failing.adopt(host, "tr_2", Outcome.success("2"))
        await failing.aclose()
    assert await finished_with(ledger, "tr_2") == Outcome.success("2")
    assert logged(caplog.records, "a recorded outcome was not posted to the invocation replicas") == 1
    following.cancel()
    await recorder.aclose()
