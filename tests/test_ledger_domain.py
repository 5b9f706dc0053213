"""The ledger's rules without servers, on a fake clock."""

from __future__ import annotations

import pytest

from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.invocation.ledger import InvocationState, Ledger, LedgerPolicy, identity_of
from toolmesh.store.memory import InMemoryStore

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> InMemoryStore:
    return InMemoryStore(clock=clock)


@pytest.fixture
def ledger(store: InMemoryStore, clock: Clock) -> Ledger:
    policy = LedgerPolicy(replay_window_s=60, timeout_replay_window_s=5, record_retention_s=300)
    return Ledger(store, policy, clock=clock)


def call(arguments: str = '{"a": 1}', tool: str = "t", session: str = "s") -> ToolCall:
    return ToolCall(session, "turn", tool, arguments)


def test_identity_ignores_spelling_but_not_meaning() -> None:
    assert identity_of(call('{"a": 1, "b": [1.0, "x"]}')) == identity_of(call('{"b":[1,"x"],"a":1e0}'))
    assert identity_of(call('{"a": 1}')) != identity_of(call('{"a": 2}'))
    assert identity_of(call('{"a": 1}')) != identity_of(call('{"a": 1}', tool="u"))
    assert identity_of(call('{"a": 1}')) != identity_of(call('{"a": 1}', session="other"))
    assert identity_of(call("not json")) is None


async def test_join_then_replay_then_confirm(ledger: Ledger) -> None:
    first = await ledger.claim(call(), "tr_1", 1000)
    assert first.is_new
    joined = await ledger.claim(call('{ "a" : 1 }'), "tr_2", 1000)
    assert not joined.is_new and joined.record.tool_request_id == "tr_1" and not joined.record.finished
    await ledger.finish("tr_1", Outcome.success("7"))
    replay = await ledger.claim(call(), "tr_3", 1000)
    assert not replay.is_new and replay.record.outcome == Outcome.success("7")
    await ledger.confirm("tr_1")
    fresh = await ledger.claim(call(), "tr_4", 1000)
    assert fresh.is_new
    record = await ledger.get("tr_1")
    assert record is not None and record.delivered and record.state is InvocationState.COMPLETED


async def test_confirm_before_the_outcome_is_refused(ledger: Ledger) -> None:
    await ledger.claim(call(), "tr_1", 1000)
    with pytest.raises(ToolmeshError) as raised:
        await ledger.confirm("tr_1")
    assert raised.value.code is Code.INVOCATION_RUNNING
    await ledger.confirm("tr_unknown")  # unknown or expired: nothing to do


async def test_replay_window_and_the_shorter_timeout_window(ledger: Ledger, clock: Clock) -> None:
    await ledger.claim(call('{"k": "ok"}'), "tr_ok", 1000)
    await ledger.finish("tr_ok", Outcome.success("1"))
    await ledger.claim(call('{"k": "slow"}'), "tr_slow", 1000)
    await ledger.finish("tr_slow", Outcome.runtime_error(Code.TOOL_TIMEOUT))
    clock.now += 10
    assert (await ledger.claim(call('{"k": "slow"}'), "tr_slow2", 1000)).is_new
    assert not (await ledger.claim(call('{"k": "ok"}'), "tr_ok2", 1000)).is_new
    clock.now += 60
    assert (await ledger.claim(call('{"k": "ok"}'), "tr_ok3", 1000)).is_new


async def test_unreachable_bridge_is_not_replayed(ledger: Ledger) -> None:
    await ledger.claim(call(), "tr_1", 1000)
    await ledger.finish("tr_1", Outcome.runtime_error(Code.BRIDGE_UNAVAILABLE))
    assert (await ledger.claim(call(), "tr_2", 1000)).is_new
    record = await ledger.get("tr_1")
    assert record is not None and record.state is InvocationState.FAILED


@pytest.mark.parametrize("code", [Code.BRIDGE_UNAVAILABLE, Code.TOOL_HOST_UNAVAILABLE, Code.OVERLOADED])
async def test_a_try_again_outcome_is_not_replayed_under_an_idempotency_key(
    ledger: Ledger, code: Code
) -> None:
    assert (await ledger.claim(call(), "tr_1", 1000, "key-1")).is_new
    await ledger.finish("tr_1", Outcome.runtime_error(code))
    again = await ledger.claim(call(), "tr_2", 1000, "key-1")
    assert again.is_new and again.record.tool_request_id == "tr_2"
    # The key now belongs to the new invocation: its outcome is the one replayed.
    await ledger.finish("tr_2", Outcome.success("5"))
    third = await ledger.claim(call(), "tr_3", 1000, "key-1")
    assert not third.is_new and third.record.tool_request_id == "tr_2"


async def test_a_host_unavailable_outcome_is_not_replayed_to_an_exact_retry(ledger: Ledger) -> None:
    await ledger.claim(call(), "tr_1", 1000)
    await ledger.finish("tr_1", Outcome.runtime_error(Code.TOOL_HOST_UNAVAILABLE))
    assert (await ledger.claim(call(), "tr_2", 1000)).is_new


async def test_idempotency_key(ledger: Ledger, clock: Clock) -> None:
    assert (await ledger.claim(call(), "tr_1", 1000, "key-1")).is_new
    await ledger.finish("tr_1", Outcome.success("1"))
    await ledger.confirm("tr_1")
    clock.now += 3600  # far past the replay window, within the key's retention
    again = await ledger.claim(call('{"a":1.0}'), "tr_2", 1000, "key-1")
    assert not again.is_new and again.record.tool_request_id == "tr_1"
    with pytest.raises(ToolmeshError) as raised:
        await ledger.claim(call('{"a": 2}'), "tr_3", 1000, "key-1")
    assert raised.value.code is Code.IDEMPOTENCY_KEY_REUSED
    assert raised.value.metadata["toolRequestId"] == "tr_1"
    # Keys belong to a session.
    assert (await ledger.claim(call(session="s2"), "tr_4", 1000, "key-1")).is_new


async def test_lost_owner_running_record_expires(ledger: Ledger, clock: Clock) -> None:
    await ledger.claim(call(), "tr_1", 1000)
    clock.now += 1 + ledger.policy.running_grace_s + 1
    assert await ledger.get("tr_1") is None
    assert (await ledger.claim(call(), "tr_2", 1000)).is_new


async def test_memory_is_bounded_under_distinct_calls(
    ledger: Ledger, store: InMemoryStore, clock: Clock
) -> None:
    for index in range(3000):
        request_id = f"tr_{index}"
        await ledger.claim(call(f'{{"n": {index}}}'), request_id, 1000)
        await ledger.finish(request_id, Outcome.success("null"))
        await ledger.confirm(request_id)
        clock.now += 0.5  # 3000 calls over 25 minutes; records are kept 5 minutes
    assert len(store) < 1000
