"""The ledger's rules without servers, on each storage backend.

In memory the clock is fake and moved at will. On Redis, whose expiry runs on
the server's clock, moving the clock also lets that much real time pass, so
the windows here are short (scaled down from the defaults).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import ledger_policy
from toolmesh.contracts.ledger import CancelVerdict, InvocationState, Ledger, LedgerPolicy, identity_of
from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.rules.limits import limits_from
from toolmesh.store import slots
from toolmesh.store.backends import open_stores
from toolmesh.store.ledger import Delivered, LeaseRefused, LeaseTerms, LedgerStore, MarkVerdict, StartMark
from toolmesh.store.memory import MemoryLedgerStore

POLICY = LedgerPolicy(
    replay_window_s=2.0,
    timeout_replay_window_s=0.1,
    record_retention_s=5.0,
    running_grace_s=0.2,
    owner_grace_s=0.1,  # within running_grace_s: the running record is still there
    late_retry_notice_s=1.0,
)


class Clock:
    def __init__(self, real: bool) -> None:
        self.now = 1_000.0
        self._real = real

    def __call__(self) -> float:
        return self.now

    async def advance(self, seconds: float) -> None:
        self.now += seconds
        if self._real:
            await asyncio.sleep(seconds)


# Each backend's marks: the in-process one is a unit test, one behind a server an integration test.
@pytest_asyncio.fixture(
    params=[
        pytest.param("memory", marks=pytest.mark.unit),
        pytest.param("redis", marks=pytest.mark.integration),
        # Sessions sharded over three primaries, each with a replica (durable claims on).
        pytest.param("cluster", marks=pytest.mark.integration),
    ]
)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[tuple[LedgerStore, Clock, str]]:
    """The ledger store, the clock, and the Redis key prefix ("" in memory)."""
    if request.param == "memory":
        clock = Clock(real=False)
        yield MemoryLedgerStore(clock=clock), clock, ""
        return
    prefix = new_prefix()
    # The cluster is this test process's own: its keys (every ledger key expires) go with it.
    url = request.getfixturevalue("redis_cluster").url if request.param == "cluster" else SHARED_URL
    stores = open_stores(url, prefix)
    yield stores.ledger, Clock(real=True), prefix
    await stores.close()
    if url == SHARED_URL:
        await delete_prefixed(SHARED_URL, prefix)


@pytest.fixture
def clock(backend: tuple[LedgerStore, Clock, str]) -> Clock:
    return backend[1]


@pytest.fixture
def ledger(backend: tuple[LedgerStore, Clock, str]) -> Ledger:
    return Ledger(backend[0], POLICY, clock=backend[1])


async def window_passed(ledger: Ledger, exact: ToolCall, tool_request_id: str) -> None:
    """An exact retry of `tool_request_id` after its window is refused, naming it; nothing is claimed."""
    with pytest.raises(ToolmeshError) as raised:
        await ledger.claim(exact, tr("late"), 10_000)
    assert raised.value.code is Code.RETRY_WINDOW_PASSED
    assert raised.value.metadata["toolRequestId"] == tool_request_id
    assert await ledger.get(tr("late")) is None


def tr(name: str) -> str:
    """A tool request id named `name`, carrying a slot tag as the invocation service mints them (a
    cluster refuses to claim an id without one)."""
    return slots.tool_request_id("s", name.replace("_", ""))


def call(arguments: str = '{"a": 1}', tool: str = "t", session: str = "s") -> ToolCall:
    return ToolCall(session, "turn", tool, arguments)


def delivered(*tool_request_ids: str) -> list[Delivered]:
    """Confirmations in the id-only form: every attachment of each invocation."""
    return [Delivered(tool_request_id) for tool_request_id in tool_request_ids]


@pytest.mark.unit
def test_identity_ignores_spelling_but_not_meaning() -> None:
    assert identity_of(call('{"a": 1, "b": [1.0, "x"]}')) == identity_of(call('{"b":[1,"x"],"a":1e0}'))
    assert identity_of(call('{"a": 1}')) != identity_of(call('{"a": 2}'))
    assert identity_of(call('{"a": 1}')) != identity_of(call('{"a": 1}', tool="u"))
    assert identity_of(call('{"a": 1}')) != identity_of(call('{"a": 1}', session="other"))
    assert identity_of(call("not json")) is None


async def test_join_then_replay_then_confirm(ledger: Ledger) -> None:
    first = await ledger.claim(call(), tr("1"), 10_000)
    assert first.is_new
    joined = await ledger.claim(call('{ "a" : 1 }'), tr("2"), 10_000)
    assert not joined.is_new and joined.record.tool_request_id == tr("1") and not joined.record.finished
    await ledger.finish(tr("1"), Outcome.success("7"))
    replay = await ledger.claim(call(), tr("3"), 10_000)
    assert not replay.is_new and replay.record.outcome == Outcome.success("7")
    await ledger.confirm(tr("1"))
    fresh = await ledger.claim(call(), tr("4"), 10_000)
    assert fresh.is_new
    record = await ledger.get(tr("1"))
    assert record is not None and record.delivered and record.state is InvocationState.COMPLETED


async def test_each_call_attached_to_an_invocation_gets_its_own_attachment(ledger: Ledger) -> None:
    first = await ledger.claim(call(), tr("1"), 10_000)
    joined = await ledger.claim(call(), tr("2"), 10_000)
    await ledger.finish(tr("1"), Outcome.success("7"))
    replayed = await ledger.claim(call(), tr("3"), 10_000)
    assert [first.attachment_id, joined.attachment_id, replayed.attachment_id] == ["1", "2", "3"]


async def test_a_confirmation_releases_the_invocation_only_for_its_caller(ledger: Ledger) -> None:
    """Caller A gave up (attachment 1); B joined (2), got the outcome and confirmed: A's exact
    retry still replays; once A confirmed too, an identical call runs anew."""
    await ledger.claim(call(), tr("1"), 10_000)
    joined = await ledger.claim(call(), tr("2"), 10_000)
    await ledger.finish(tr("1"), Outcome.success("7"))
    await ledger.confirm(tr("1"), attachment_id=joined.attachment_id)
    await ledger.confirm(tr("1"), attachment_id=joined.attachment_id)  # twice: still only B's
    await ledger.confirm(tr("1"), attachment_id="99")  # no such attachment: nothing
    retry = await ledger.claim(call(), tr("3"), 10_000)
    assert not retry.is_new and retry.record.tool_request_id == tr("1")
    assert retry.record.outcome == Outcome.success("7")
    record = await ledger.get(tr("1"))
    assert record is not None and not record.delivered
    # A confirms the attachment its first call made and its retry's, carried on its next call.
    mine = [Delivered(tr("1"), "1"), Delivered(tr("1"), retry.attachment_id)]
    fresh = await ledger.claim(call(), tr("4"), 10_000, confirmed=mine)
    assert fresh.is_new
    record = await ledger.get(tr("1"))
    assert record is not None and record.delivered


async def test_an_attachment_never_confirmed_holds_the_invocation_only_within_the_window(
    ledger: Ledger, clock: Clock
) -> None:
    await ledger.claim(call(), tr("1"), 10_000)  # its caller gives up for good
    joined = await ledger.claim(call(), tr("2"), 10_000)
    await ledger.finish(tr("1"), Outcome.success("7"))
    await ledger.confirm(tr("1"), attachment_id=joined.attachment_id)
    assert not (await ledger.claim(call(), tr("3"), 10_000)).is_new
    await clock.advance(POLICY.replay_window_s + 0.1)
    await window_passed(ledger, call(), tr("1"))
    await clock.advance(POLICY.late_retry_notice_s)
    assert (await ledger.claim(call(), tr("4"), 10_000)).is_new


async def test_the_claimant_s_replay_window_holds_whoever_finishes(
    backend: tuple[LedgerStore, Clock, str],
) -> None:
    """A bridge replica records the host's outcome with a ledger of its own default policy."""
    store, clock, _ = backend
    claimant, bridge = Ledger(store, POLICY, clock=clock), Ledger(store, LedgerPolicy(), clock=clock)
    await claimant.claim(call(), tr("1"), 10_000)
    await bridge.finish(tr("1"), Outcome.success("7"))
    assert not (await claimant.claim(call(), tr("2"), 10_000)).is_new
    await clock.advance(POLICY.replay_window_s + 0.1)
    await window_passed(claimant, call(), tr("1"))
    await window_passed(bridge, call(), tr("1"))
    await clock.advance(POLICY.late_retry_notice_s)
    assert (await claimant.claim(call(), tr("3"), 10_000)).is_new


async def test_the_id_alone_confirms_every_attachment(ledger: Ledger) -> None:
    await ledger.claim(call(), tr("1"), 10_000)
    await ledger.claim(call(), tr("2"), 10_000)
    await ledger.finish(tr("1"), Outcome.success("7"))
    await ledger.confirm(tr("1"))
    assert (await ledger.claim(call(), tr("3"), 10_000)).is_new
    record = await ledger.get(tr("1"))
    assert record is not None and record.delivered


async def test_an_idempotency_key_attaches_each_retry(ledger: Ledger) -> None:
    first = await ledger.claim(call(), tr("1"), 10_000, "key-1")
    await ledger.finish(tr("1"), Outcome.success("1"))
    again = await ledger.claim(call(), tr("2"), 10_000, "key-1")
    assert not again.is_new and again.attachment_id == "2"
    await ledger.confirm(tr("1"), attachment_id=first.attachment_id)
    record = await ledger.get(tr("1"))
    assert record is not None and not record.delivered  # the retry's caller has not confirmed
    await ledger.confirm(tr("1"), attachment_id=again.attachment_id)
    record = await ledger.get(tr("1"))
    assert record is not None and record.delivered
    # A delivered keyed invocation still answers its key; a confirmation of that attachment is harmless.
    late = await ledger.claim(call(), tr("3"), 10_000, "key-1")
    assert not late.is_new and late.record.delivered and late.attachment_id == "3"
    await ledger.confirm(tr("1"), attachment_id=late.attachment_id)


async def test_confirm_before_the_outcome_is_refused(ledger: Ledger) -> None:
    await ledger.claim(call(), tr("1"), 10_000)
    with pytest.raises(ToolmeshError) as raised:
        await ledger.confirm(tr("1"))
    assert raised.value.code is Code.INVOCATION_RUNNING
    await ledger.confirm(tr("unknown"))  # unknown or expired: nothing to do


async def test_replay_window_and_the_shorter_timeout_window(ledger: Ledger, clock: Clock) -> None:
    await ledger.claim(call('{"k": "ok"}'), tr("ok"), 10_000)
    await ledger.finish(tr("ok"), Outcome.success("1"))
    await ledger.claim(call('{"k": "slow"}'), tr("slow"), 10_000)
    await ledger.finish(tr("slow"), Outcome.runtime_error(Code.TOOL_TIMEOUT))
    await clock.advance(0.3)
    await window_passed(ledger, call('{"k": "slow"}'), tr("slow"))
    assert not (await ledger.claim(call('{"k": "ok"}'), tr("ok2"), 10_000)).is_new
    await clock.advance(POLICY.late_retry_notice_s)
    assert (await ledger.claim(call('{"k": "slow"}'), tr("slow2"), 10_000)).is_new
    await clock.advance(POLICY.replay_window_s - POLICY.late_retry_notice_s)
    await window_passed(ledger, call('{"k": "ok"}'), tr("ok"))
    await clock.advance(POLICY.late_retry_notice_s)
    assert (await ledger.claim(call('{"k": "ok"}'), tr("ok3"), 10_000)).is_new


async def test_unreachable_bridge_is_not_replayed(ledger: Ledger) -> None:
    await ledger.claim(call(), tr("1"), 10_000)
    await ledger.finish(tr("1"), Outcome.runtime_error(Code.BRIDGE_UNAVAILABLE))
    assert (await ledger.claim(call(), tr("2"), 10_000)).is_new
    record = await ledger.get(tr("1"))
    assert record is not None and record.state is InvocationState.FAILED


@pytest.mark.parametrize("code", [Code.BRIDGE_UNAVAILABLE, Code.TOOL_HOST_UNAVAILABLE, Code.OVERLOADED])
async def test_a_try_again_outcome_is_not_replayed_under_an_idempotency_key(
    ledger: Ledger, code: Code
) -> None:
    assert (await ledger.claim(call(), tr("1"), 10_000, "key-1")).is_new
    await ledger.finish(tr("1"), Outcome.runtime_error(code))
    again = await ledger.claim(call(), tr("2"), 10_000, "key-1")
    assert again.is_new and again.record.tool_request_id == tr("2")
    # The key now belongs to the new invocation: its outcome is the one replayed.
    await ledger.finish(tr("2"), Outcome.success("5"))
    third = await ledger.claim(call(), tr("3"), 10_000, "key-1")
    assert not third.is_new and third.record.tool_request_id == tr("2")


async def test_a_host_unavailable_outcome_is_not_replayed_to_an_exact_retry(ledger: Ledger) -> None:
    await ledger.claim(call(), tr("1"), 10_000)
    await ledger.finish(tr("1"), Outcome.runtime_error(Code.TOOL_HOST_UNAVAILABLE))
    assert (await ledger.claim(call(), tr("2"), 10_000)).is_new


async def test_idempotency_key(ledger: Ledger, clock: Clock) -> None:
    assert (await ledger.claim(call(), tr("1"), 10_000, "key-1")).is_new
    await ledger.finish(tr("1"), Outcome.success("1"))
    await ledger.confirm(tr("1"))
    await clock.advance(POLICY.replay_window_s + 0.2)  # past the replay window, within the key's retention
    again = await ledger.claim(call('{"a":1.0}'), tr("2"), 10_000, "key-1")
    assert not again.is_new and again.record.tool_request_id == tr("1")
    with pytest.raises(ToolmeshError) as raised:
        await ledger.claim(call('{"a": 2}'), tr("3"), 10_000, "key-1")
    assert raised.value.code is Code.IDEMPOTENCY_KEY_REUSED
    assert raised.value.metadata["toolRequestId"] == tr("1")
    # Keys belong to a session.
    assert (await ledger.claim(call(session="s2"), tr("4"), 10_000, "key-1")).is_new


async def test_lost_owner_running_record_outlives_its_exact_retries_then_expires(
    ledger: Ledger, clock: Clock
) -> None:
    """Its owner died and nobody waited on it: an exact retry within the replay window joins it
    (and then ends it TOOL_TIMEOUT, owner lost), it does not run the tool again."""
    await ledger.claim(call(), tr("1"), 100)
    await clock.advance(0.1 + POLICY.running_grace_s + 0.1)
    retried = await ledger.claim(call(), tr("2"), 10_000)
    assert not retried.is_new and retried.record.tool_request_id == tr("1")
    kept = POLICY.owner_grace_s + POLICY.timeout_replay_window_s + POLICY.late_retry_notice_s
    assert ledger.orphan_kept_s() == kept > POLICY.running_grace_s
    await clock.advance(kept)
    assert await ledger.get(tr("1")) is None
    assert (await ledger.claim(call(), tr("3"), 10_000)).is_new


@pytest.mark.unit
async def test_memory_is_bounded_under_distinct_calls() -> None:
    clock = Clock(real=False)
    store = MemoryLedgerStore(clock=clock)
    ledger = Ledger(store, LedgerPolicy(record_retention_s=300), clock=clock)
    for index in range(3000):
        request_id = f"tr_{index}"
        await ledger.claim(call(f'{{"n": {index}}}'), request_id, 1000)
        await ledger.finish(request_id, Outcome.success("null"))
        await ledger.confirm(request_id)
        await clock.advance(0.5)  # 3000 calls over 25 minutes; records are kept 5 minutes
    assert len(store) < 1000


@pytest.mark.integration
async def test_every_ledger_key_in_redis_expires() -> None:
    prefix = new_prefix()
    stores = open_stores(SHARED_URL, prefix)
    ledger = Ledger(stores.ledger)
    client = Redis.from_url(SHARED_URL)
    try:
        await ledger.claim(call('{"n": 1}'), tr("run"), 10_000)
        await ledger.claim(call('{"n": 2}'), tr("done"), 10_000)
        await ledger.finish(tr("done"), Outcome.success("1"))
        await ledger.claim(call('{"n": 3}'), tr("keyed"), 1000, "key")
        await ledger.claim(call('{"n": 4}'), tr("confirmed"), 10_000)
        await ledger.finish(tr("confirmed"), Outcome.success("1"))
        await ledger.confirm(tr("confirmed"))
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        # 4 records, 2 identity pointers (none for the keyed call, the confirmed one's dropped), 1 key.
        assert len(keys) == 7
        for key in keys:
            assert await client.pttl(key) > 0, key
    finally:
        await client.aclose()
        await stores.close()
        await delete_prefixed(SHARED_URL, prefix)


async def test_a_joiner_elsewhere_waits_for_the_finish(backend: tuple[LedgerStore, Clock, str]) -> None:
    """Two ledgers on one store (two replicas): the second joins and is woken by the first's finish."""
    store, clock, _ = backend
    owner, joiner = Ledger(store, POLICY, clock=clock), Ledger(store, POLICY, clock=clock)
    assert (await owner.claim(call(), tr("1"), 10_000)).is_new
    joined = await joiner.claim(call(), tr("2"), 10_000)
    assert not joined.is_new and joined.record.tool_request_id == tr("1")
    waiting = asyncio.ensure_future(joiner.wait_finished(tr("1")))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await owner.finish(tr("1"), Outcome.success("42"))
    record = await asyncio.wait_for(waiting, 5)
    assert record is not None and record.outcome == Outcome.success("42")


@pytest.mark.integration
async def test_a_joiner_is_told_when_the_running_record_expires_in_redis() -> None:
    prefix = new_prefix()
    stores = open_stores(SHARED_URL, prefix)
    try:
        owner = Ledger(stores.ledger, POLICY)
        await owner.claim(call(), tr("1"), 100)  # and its owner dies: nobody finishes it
        assert await asyncio.wait_for(owner.wait_finished(tr("1")), 5) is None
    finally:
        await stores.close()
        await delete_prefixed(SHARED_URL, prefix)


async def test_confirmations_carried_on_a_claim_apply_before_it(ledger: Ledger) -> None:
    await ledger.claim(call(), tr("1"), 10_000)
    await ledger.finish(tr("1"), Outcome.success("1"))
    await ledger.claim(call('{"other": 1}'), tr("running"), 10_000)
    # The exact retry that carries the first call's confirmation is a new invocation.
    retry = await ledger.claim(
        call(), tr("2"), 10_000, confirmed=delivered(tr("1"), tr("running"), tr("unknown"))
    )
    assert retry.is_new
    first = await ledger.get(tr("1"))
    assert first is not None and first.delivered
    running = await ledger.get(tr("running"))
    assert running is not None and not running.delivered and not running.finished
    await ledger.finish(tr("2"), Outcome.success("2"))
    keyed = await ledger.claim(call(), tr("3"), 10_000, "key-1", confirmed=delivered(tr("2")))
    assert keyed.is_new
    second = await ledger.get(tr("2"))
    assert second is not None and second.delivered


async def test_confirmations_of_other_sessions_change_nothing(ledger: Ledger) -> None:
    for session, request_id in (("mine", tr("mine")), ("theirs", tr("theirs"))):
        await ledger.claim(call(session=session), request_id, 10_000)
        await ledger.finish(request_id, Outcome.success("1"))
    allowed = await ledger.permitted(delivered(tr("mine"), tr("theirs"), tr("unknown")), {"mine"})
    assert list(allowed) == delivered(tr("mine"))
    await ledger.confirm(tr("theirs"), {"mine"})
    theirs = await ledger.get(tr("theirs"))
    assert theirs is not None and not theirs.delivered
    await ledger.confirm(tr("mine"), {"mine"})
    mine = await ledger.get(tr("mine"))
    assert mine is not None and mine.delivered


async def test_the_first_finish_wins_and_an_unknown_invocation_is_not_made(ledger: Ledger) -> None:
    # The bridge replica and the invocation replica may both record the outcome.
    await ledger.claim(call(), tr("1"), 10_000)
    await ledger.finish(tr("1"), Outcome.success("1"))
    await ledger.finish(tr("1"), Outcome.runtime_error(Code.TOOL_TIMEOUT))
    record = await ledger.get(tr("1"))
    assert record is not None and record.outcome == Outcome.success("1")
    await ledger.finish(tr("never_claimed"), Outcome.success("1"))
    assert await ledger.get(tr("never_claimed")) is None


async def test_a_late_outcome_is_kept_once_beside_a_timeout_and_only_there(ledger: Ledger) -> None:
    timed_out = Outcome.runtime_error(Code.TOOL_TIMEOUT)
    claimed = await ledger.claim(call(), tr("1"), 10_000)
    # Still running: nothing to keep it beside (the host's outcome is a finish then).
    assert not await ledger.keep_late(claimed.record, Outcome.success("1"))
    await ledger.finish(tr("1"), timed_out, claimed=claimed.record)
    record = await ledger.get(tr("1"))
    assert record is not None and record.late_outcome is None and record.late_at is None
    assert await ledger.keep_late(record, Outcome.success("1"))
    assert not await ledger.keep_late(record, Outcome.success("2"))  # the first one stays
    record = await ledger.get(tr("1"))
    assert record is not None and record.outcome == timed_out and record.late_outcome == Outcome.success("1")
    assert record.late_at is not None and record.finished_at is not None
    assert record.late_at >= record.finished_at
    # Kept through the delivery's confirmation, which rewrites what the store keeps beside the record.
    await ledger.confirm_all(delivered(tr("1")))
    record = await ledger.get(tr("1"))
    assert record is not None and record.delivered and record.late_outcome == Outcome.success("1")
    # Only beside a timeout: an answered invocation's outcome is the handler's already.
    claimed = await ledger.claim(call('{"a": 2}'), tr("2"), 10_000)
    await ledger.finish(tr("2"), Outcome.success("2"), claimed=claimed.record)
    answered = await ledger.get(tr("2"))
    assert answered is not None and not await ledger.keep_late(answered, Outcome.success("3"))
    answered = await ledger.get(tr("2"))
    assert answered is not None and answered.late_outcome is None


async def test_finish_first_gives_the_outcome_that_stands(ledger: Ledger) -> None:
    # The invocation replica's TOOL_TIMEOUT loses to the result a bridge replica recorded first.
    claimed = await ledger.claim(call(), tr("1"), 10_000)
    await ledger.finish(tr("1"), Outcome.success("1"))
    timed_out = Outcome.runtime_error(Code.TOOL_TIMEOUT)
    assert await ledger.finish_first(tr("1"), timed_out, claimed=claimed.record) == Outcome.success("1")
    # Written first, its own outcome stands.
    claimed = await ledger.claim(call('{"a": 2}'), tr("2"), 10_000)
    assert await ledger.finish_first(tr("2"), timed_out, claimed=claimed.record) == timed_out
    record = await ledger.get(tr("2"))
    assert record is not None and record.outcome == timed_out
    # After a cancellation, TOOL_CANCELLED.
    claimed = await ledger.claim(call('{"a": 3}'), tr("3"), 10_000)
    assert await ledger.cancel(claimed.record) is CancelVerdict.CANCELLED
    stands = await ledger.finish_first(tr("3"), Outcome.success("3"), claimed=claimed.record)
    assert stands.failure is not None and stands.failure.code == Code.TOOL_CANCELLED.value


async def test_a_call_whose_owner_is_lost_ends_timed_out_after_its_deadline_and_grace(ledger: Ledger) -> None:
    await ledger.claim(call(), tr("1"), 100)  # its owner never finishes it
    started = asyncio.get_running_loop().time()
    record = await asyncio.wait_for(ledger.outcome_from_owner(tr("1"), 100), 5)
    assert asyncio.get_running_loop().time() - started >= 0.15  # not before deadline + grace
    assert record is not None and record.state is InvocationState.TIMED_OUT and record.outcome is not None
    failure = record.outcome.failure
    assert failure is not None and failure.code == "TOOL_TIMEOUT"
    assert failure.details is not None and failure.details["ownerLost"] is True


async def test_an_outcome_recorded_by_the_owner_in_time_wins(ledger: Ledger) -> None:
    await ledger.claim(call(), tr("1"), 10_000)
    waiting = asyncio.create_task(ledger.outcome_from_owner(tr("1"), 10_000))
    await ledger.finish(tr("1"), Outcome.success("5"))
    record = await asyncio.wait_for(waiting, 5)
    assert record is not None and record.outcome == Outcome.success("5")


async def test_a_cancel_ends_a_running_invocation_and_is_replayed(ledger: Ledger) -> None:
    claimed = await ledger.claim(call(), tr("1"), 10_000)
    assert await ledger.cancel(claimed.record) is CancelVerdict.CANCELLED
    record = await ledger.get(tr("1"))
    assert record is not None and record.state is InvocationState.CANCELLED and record.outcome is not None
    assert record.outcome.code == Code.TOOL_CANCELLED
    # The owner's own outcome arrives too late: the first finish won.
    await ledger.finish(tr("1"), Outcome.success("1"))
    replay = await ledger.claim(call(), tr("2"), 10_000)
    assert not replay.is_new and replay.record.outcome == record.outcome
    # Cancelling again, or what has ended, changes nothing.
    assert await ledger.cancel(claimed.record) is CancelVerdict.ENDED


async def test_a_cancel_leaves_alone_an_invocation_a_call_joined(ledger: Ledger) -> None:
    claimed = await ledger.claim(call(), tr("1"), 10_000)
    joined = await ledger.claim(call(), tr("2"), 10_000)
    assert not joined.is_new
    assert await ledger.cancel(claimed.record) is CancelVerdict.JOINED
    record = await ledger.get(tr("1"))
    assert record is not None and not record.finished
    keyed = await ledger.claim(call('{"k": 1}'), tr("k1"), 10_000, idempotency_key="key")
    assert not (await ledger.claim(call('{"k": 1}'), tr("k2"), 10_000, idempotency_key="key")).is_new
    assert await ledger.cancel(keyed.record) is CancelVerdict.JOINED


async def test_a_replayed_call_does_not_count_as_joined_and_a_gone_invocation_is_none(
    ledger: Ledger,
) -> None:
    claimed = await ledger.claim(call(), tr("1"), 10_000)
    await ledger.finish(tr("1"), Outcome.success("1"))
    assert not (await ledger.claim(call(), tr("2"), 10_000)).is_new  # a replay, not a join
    assert await ledger.cancel(claimed.record) is CancelVerdict.ENDED
    never = replace(claimed.record, tool_request_id=tr("never_claimed"))
    assert await ledger.cancel(never) is None


async def test_a_finish_after_a_cancel_says_the_invocation_was_cancelled(
    backend: tuple[LedgerStore, Clock, str], ledger: Ledger
) -> None:
    store = backend[0]
    claimed = await ledger.claim(call(), tr("1"), 10_000)
    assert await ledger.cancel(claimed.record) is CancelVerdict.CANCELLED
    # The owner's outcome came as the cancel did: the ledger's TOOL_CANCELLED is everyone's.
    assert await ledger.finish(tr("1"), Outcome.success("1")) is False
    assert await store.finish(tr("1"), b"{}", "", 1.0, 1.0) == "cancelled"
    other = await ledger.claim(call('{"b": 2}'), tr("2"), 10_000)
    assert await ledger.finish(tr("2"), Outcome.success("2")) is True
    assert other.is_new and await store.finish(tr("2"), b"{}", "", 1.0, 1.0) == "ended"
    assert await store.finish(tr("never"), b"{}", "", 1.0, 1.0) == "ended"


# The session's place among calls in flight, taken and given back in the claim's and finish's own steps.
ONE_PLACE = LeaseTerms("quota:in_flight:s", 1, 30.0)


async def refused(ledger: Ledger, new_id: str, idempotency_key: str = "") -> None:
    """A claim for a new invocation finds the place taken: refused, nothing claimed."""
    with pytest.raises(LeaseRefused):
        await ledger.claim(
            call(f'{{"refused": "{new_id}"}}'), new_id, 10_000, idempotency_key, lease=ONE_PLACE
        )
    assert await ledger.get(new_id) is None


async def test_a_new_invocation_holds_its_place_until_it_finishes(ledger: Ledger) -> None:
    assert (await ledger.claim(call(), tr("1"), 10_000, lease=ONE_PLACE)).is_new
    await refused(ledger, tr("2"))
    await refused(ledger, tr("3"), idempotency_key="k")
    joined = await ledger.claim(call(), tr("4"), 10_000, lease=ONE_PLACE)  # a join takes no place
    assert not joined.is_new and joined.record.tool_request_id == tr("1")
    await ledger.finish(tr("1"), Outcome.success("1"))
    replayed = await ledger.claim(call(), tr("5"), 10_000, lease=ONE_PLACE)
    assert not replayed.is_new
    # The keyed claim refused before left no key behind: this one is new, not KeyReused.
    keyed = await ledger.claim(call('{"a": 3}'), tr("6"), 10_000, "k", lease=ONE_PLACE)
    assert keyed.is_new
    await refused(ledger, tr("7"))
    # A replay under the key takes no place either.
    assert not (await ledger.claim(call('{"a": 3}'), tr("8"), 10_000, "k", lease=ONE_PLACE)).is_new


async def test_a_cancel_and_a_lost_owner_give_the_place_back(ledger: Ledger) -> None:
    claimed = await ledger.claim(call(), tr("1"), 10_000, lease=ONE_PLACE)
    assert await ledger.cancel(claimed.record) is CancelVerdict.CANCELLED
    assert (await ledger.claim(call('{"a": 2}'), tr("2"), 100, lease=ONE_PLACE)).is_new
    record = await asyncio.wait_for(ledger.outcome_from_owner(tr("2"), 100), 5)
    assert record is not None and record.state is InvocationState.TIMED_OUT
    assert (await ledger.claim(call('{"a": 3}'), tr("3"), 10_000, lease=ONE_PLACE)).is_new


async def test_a_place_is_given_back_apart_and_lapses_after_its_ttl(ledger: Ledger, clock: Clock) -> None:
    await ledger.claim(call(), tr("1"), 10_000, lease=ONE_PLACE)
    await ledger.release_lease(ONE_PLACE, tr("1"))  # its caller left before an outcome
    await ledger.release_lease(ONE_PLACE, tr("1"))  # twice, or never held: nothing
    brief = LeaseTerms(ONE_PLACE.key, 1, 0.05)
    assert (await ledger.claim(call('{"a": 2}'), tr("2"), 10_000, lease=brief)).is_new
    await refused(ledger, tr("3"))
    await clock.advance(0.1)
    assert (await ledger.claim(call('{"a": 4}'), tr("4"), 10_000, lease=ONE_PLACE)).is_new


def limits_policy(*settings: str) -> LedgerPolicy:
    """The policy an invocation service builds from its `--limit` flags."""
    return ledger_policy(limits_from(list(settings), environ={}))


@pytest.mark.unit
def test_the_default_windows_cover_an_agent_s_retry_budget() -> None:
    policy = limits_policy()
    assert policy.replay_window_s == policy.timeout_replay_window_s == 600.0
    assert policy.late_retry_notice_s == 1800.0
    set_by_flags = limits_policy("replay_window_s=30", "timeout_replay_window_s=45", "late_retry_notice_s=7")
    assert (set_by_flags.replay_window_s, set_by_flags.timeout_replay_window_s) == (30.0, 45.0)
    assert set_by_flags.late_retry_notice_s == 7.0


@pytest.mark.parametrize("outcome", [Outcome.runtime_error(Code.TOOL_TIMEOUT), Outcome.success("1")])
async def test_windows_set_through_the_limits_replay_then_say_the_window_passed(
    backend: tuple[LedgerStore, Clock, str], outcome: Outcome
) -> None:
    """Inside the window an exact retry replays; after it, RETRY_WINDOW_PASSED (nothing runs) for the
    notice; after that the ledger has forgotten the call and it runs anew."""
    store, clock, _ = backend
    policy = replace(
        limits_policy("replay_window_s=1", "timeout_replay_window_s=1", "late_retry_notice_s=1"),
        record_retention_s=0.5,  # shorter than the pointer: the record is kept as long as it
    )
    ledger = Ledger(store, policy, clock=clock)
    first = await ledger.claim(call(), tr("1"), 10_000)
    safe_until = ledger.retry_safe_until(first.record)
    assert safe_until == clock.now + 1.0
    await ledger.finish(tr("1"), outcome, claimed=first.record)
    await clock.advance(0.6)
    replayed = await ledger.claim(call(), tr("2"), 10_000)
    assert not replayed.is_new and replayed.record.outcome == outcome
    await clock.advance(0.6)
    with pytest.raises(ToolmeshError) as raised:
        await ledger.claim(call(), tr("3"), 10_000)
    assert raised.value.code is Code.RETRY_WINDOW_PASSED
    assert raised.value.metadata["toolRequestId"] == tr("1")
    assert raised.value.metadata["replayWindowS"] == "1"
    assert raised.value.metadata["retrySafeUntil"].endswith("Z")
    assert await ledger.get(tr("3")) is None  # nothing claimed, nothing to run
    still = await ledger.get(tr("1"))
    assert still is not None and still.outcome == outcome  # reconcilable past record_retention_s
    await clock.advance(1.0)
    assert (await ledger.claim(call(), tr("4"), 10_000)).is_new


async def test_a_late_retry_runs_anew_once_the_earlier_invocation_is_confirmed(
    backend: tuple[LedgerStore, Clock, str],
) -> None:
    store, clock, _ = backend
    ledger = Ledger(
        store,
        limits_policy("replay_window_s=1", "timeout_replay_window_s=1", "late_retry_notice_s=60"),
        clock=clock,
    )
    await ledger.claim(call(), tr("1"), 10_000)
    await ledger.finish(tr("1"), Outcome.runtime_error(Code.TOOL_TIMEOUT))
    await clock.advance(1.1)
    await window_passed(ledger, call(), tr("1"))
    await ledger.confirm(tr("1"))  # reconciled: the caller means to run it again
    assert (await ledger.claim(call(), tr("2"), 10_000)).is_new


# The start fence: a bridge marks a delivery's start (compare-and-set on its dispatch generation);
# the invocation service's redispatch moves the generation on only while no start is marked.


async def test_of_two_concurrent_starts_of_one_delivery_one_wins(ledger: Ledger) -> None:
    await ledger.claim(call(), tr("1"), 10_000)
    verdicts = await asyncio.gather(
        ledger.mark_started([StartMark(tr("1"), 1)]), ledger.mark_started([StartMark(tr("1"), 1)])
    )
    assert sorted(verdict.value for [verdict] in verdicts) == ["lost", "won"]
    record = await ledger.get(tr("1"))
    assert record is not None and record.started_at is not None
    assert abs(record.started_at - time.time()) < 60  # the store's clock, in Unix seconds
    # Started: the invocation service may not send it elsewhere.
    assert await ledger.redispatch(tr("1"), 1) == 0


async def test_a_mark_asked_again_by_its_marker_wins_again_and_no_other_marker_does(ledger: Ledger) -> None:
    # A bridge that asks again after its mark's reply was lost (the store restarting) finds its own.
    await ledger.claim(call(), tr("1"), 10_000)
    assert await ledger.mark_started([StartMark(tr("1"), 1, "bridge-a")]) == [MarkVerdict.WON]
    assert await ledger.mark_started([StartMark(tr("1"), 1, "bridge-a")]) == [MarkVerdict.WON]
    assert await ledger.mark_started([StartMark(tr("1"), 1, "bridge-b"), StartMark(tr("1"), 1)]) == [
        MarkVerdict.LOST,
        MarkVerdict.LOST,
    ]
    assert await ledger.redispatch(tr("1"), 1) == 0
    # Once the generation moved on, the old delivery's marker no longer wins.
    await ledger.claim(call('{"a": 2}'), tr("2"), 10_000)
    assert await ledger.redispatch(tr("2"), 1) == 2
    assert await ledger.mark_started([StartMark(tr("2"), 1, "bridge-a")]) == [MarkVerdict.LOST]
    assert await ledger.mark_started([StartMark(tr("2"), 2, "bridge-b")]) == [MarkVerdict.WON]
    assert await ledger.mark_started([StartMark(tr("2"), 1, "bridge-b")]) == [MarkVerdict.LOST]


async def test_a_redispatch_fences_the_old_delivery_and_only_one_generation_moves_it_on(
    ledger: Ledger,
) -> None:
    await ledger.claim(call(), tr("1"), 10_000)
    assert await ledger.redispatch(tr("1"), 1) == 2
    assert await ledger.redispatch(tr("1"), 1) == 0  # another redispatch of the same delivery loses
    # The lost replica's delivery (generation 1) can no longer start; the new one can, once.
    assert await ledger.mark_started([StartMark(tr("1"), 1)]) == [MarkVerdict.LOST]
    assert await ledger.mark_started([StartMark(tr("1"), 2), StartMark(tr("1"), 2)]) == [
        MarkVerdict.WON,
        MarkVerdict.LOST,
    ]
    assert await ledger.redispatch(tr("1"), 2) == 0
    record = await ledger.get(tr("1"))
    assert record is not None and record.started_at is not None


async def test_marks_of_several_invocations_go_together_and_an_ended_or_unknown_one_is_not_started(
    ledger: Ledger,
) -> None:
    """An unknown one is ABSENT (its claim may be on its way: a request is sent while it is) and
    is marked once claimed."""
    other_session = slots.tool_request_id("s2", "other")
    await ledger.claim(call(), tr("1"), 10_000)
    await ledger.claim(call('{"a": 2}'), tr("2"), 10_000)
    await ledger.claim(call(session="s2"), other_session, 10_000)
    await ledger.finish(tr("2"), Outcome.success("1"))
    marks = [StartMark(tr("1"), 1), StartMark(tr("2"), 1), StartMark(other_session, 1), StartMark(tr("x"), 1)]
    assert await ledger.mark_started(marks) == [
        MarkVerdict.WON,
        MarkVerdict.ENDED,
        MarkVerdict.WON,
        MarkVerdict.ABSENT,
    ]
    assert await ledger.redispatch(tr("2"), 1) == 0  # ended
    assert await ledger.redispatch(tr("x"), 1) == 0  # never claimed
    assert await ledger.get(tr("x")) is None
    assert await ledger.mark_started([]) == []
    await ledger.claim(call('{"a": 3}'), tr("x"), 10_000)
    assert await ledger.mark_started([StartMark(tr("x"), 1)]) == [MarkVerdict.WON]


async def test_the_start_mark_outlives_the_finish_and_a_record_without_one_says_so(ledger: Ledger) -> None:
    await ledger.claim(call(), tr("1"), 10_000)
    await ledger.claim(call('{"a": 2}'), tr("2"), 10_000)
    await ledger.mark_started([StartMark(tr("1"), 1)])
    await ledger.finish(tr("1"), Outcome.success("1"))
    await ledger.finish(tr("2"), Outcome.success("2"))
    started, unstarted = await ledger.get(tr("1")), await ledger.get(tr("2"))
    assert started is not None and started.started_at is not None and started.finished
    assert unstarted is not None and unstarted.started_at is None
