"""Exact retries never run a tool twice: join, replay, confirm, idempotency keys, host loss.

Every test runs on each ledger backend: the embedded memory, the shared Redis and a Redis Cluster.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import CallResult, InvocationClient, InvocationState, RegistryClient
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh.rules.limits import limits_from
from toolmesh.store.backends import MEMORY
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc
from toolmesh_testing import HostProcess, eventually, logged, run_cli, start_host_process

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "ledger"
TOOLS = [
    ToolSpec("count", "Counts its runs (a side effect)", '{"type": "object"}', timeout_ms=10_000),
    ToolSpec("count_short", "Counts its runs, short deadline", '{"type": "object"}', timeout_ms=1000),
    ToolSpec(
        "count_read_only",
        "Counts its runs, declared read-only",
        '{"type": "object"}',
        timeout_ms=10_000,
        annotations=ToolAnnotations(read_only=True),
    ),
]


@pytest.fixture(scope="module", params=[MEMORY, "redis", "cluster"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory: pytest.TempPathFactory, backend: str) -> Path:
    return tmp_path_factory.mktemp(f"markers-{backend}")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def ledger_system(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[LocalSystem]:
    url, prefix = (MEMORY, None) if backend == MEMORY else (SHARED_URL, new_prefix())
    if backend == "cluster":
        url = request.getfixturevalue("redis_cluster").url
    # Short windows, set as an operator sets them (`--limit`): 1 s to replay, then 1 s of notice.
    windows = limits_from(["replay_window_s=1", "timeout_replay_window_s=1", "late_retry_notice_s=1"], {})
    running = await start_local_system(heartbeat_s=0.5, limits=windows, store_url=url, store_prefix=prefix)
    async with RegistryClient(running.registry_target) as registry:
        await registry.put_tools(SESSION, TOOLS)
    yield running
    await running.stop(grace=0.5)
    if prefix is not None and url == SHARED_URL:
        await delete_prefixed(SHARED_URL, prefix)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def host(ledger_system: LocalSystem, marker_dir: Path) -> AsyncIterator[HostProcess]:
    process = await start_host_process(
        ledger_system.bridge_target, SESSION, "ledger_handlers:HANDLERS", marker_dir
    )
    yield process
    await process.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def client(ledger_system: LocalSystem, host: HostProcess) -> AsyncIterator[InvocationClient]:
    async with InvocationClient(ledger_system.invocation_target) as invocation:
        yield invocation


def runs(marker_dir: Path, key: str) -> list[str]:
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


async def count(client: InvocationClient, key: str, sleep: float = 0.0, **kwargs: Any) -> CallResult:
    return await client.invoke(SESSION, "count", {"key": key, "sleep": sleep}, turn_id="turn", **kwargs)


async def held(client: InvocationClient, key: str, **kwargs: Any) -> CallResult:
    """A call of `count` that runs until `release(marker_dir, key)`."""
    return await client.invoke(SESSION, "count", {"key": key, "hold": 1}, turn_id="turn", **kwargs)


def release(marker_dir: Path, key: str) -> None:
    (marker_dir / f"release-{key}").touch()


JOINED = "joined a running invocation"  # what the invocation service logs for each call that joins


def result_of(call: CallResult) -> Any:
    assert call.outcome is not None and call.outcome.result_json is not None, call
    return json.loads(call.outcome.result_json)


async def test_fifty_concurrent_identical_calls_run_once(
    client: InvocationClient, marker_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="toolmesh.invocation")
    pending = asyncio.gather(*(held(client, "fifty") for _ in range(50)))
    await eventually(lambda: logged(caplog.records, JOINED) == 49)
    release(marker_dir, "fifty")
    calls = await pending
    assert runs(marker_dir, "fifty") == [calls[0].tool_request_id]
    assert {call.tool_request_id for call in calls} == {calls[0].tool_request_id}
    assert {call.outcome for call in calls} == {calls[0].outcome}
    assert result_of(calls[0])["runs"] == 1
    assert sum(call.joined for call in calls) == 49


async def test_cli_gives_up_then_exact_retry_joins(
    ledger_system: LocalSystem,
    host: HostProcess,
    marker_dir: Path,
    cli_env: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = dict(cli_env, TOOLMESH_INVOCATION_ADDR=ledger_system.invocation_target)
    caplog.set_level(logging.INFO, logger="toolmesh.invocation")
    args = '{"key": "cli-join", "hold": 1}'  # runs until the test releases it
    before = time.time()
    code, out, _ = await run_cli(
        "tool-call", "--thread-id", SESSION, "--tool", "count", "--args", args, "--timeout", "1.5", env=env
    )
    assert code == 75 and json.loads(out)["outcomeReceived"] is False
    # Exit 75 says until when the same command is safe: the suite's 1 s window from the claim.
    safe_until = datetime.datetime.fromisoformat(json.loads(out)["retrySafeUntil"]).timestamp()
    assert before + 0.99 <= safe_until <= time.time() + 1.0
    await eventually(lambda: runs(marker_dir, "cli-join"))  # it runs on without the caller
    # The same call, spelled differently: key order, spacing, number form.
    retry_args = '{ "hold": 1.0e0,"key":"cli-join" }'
    retry = asyncio.ensure_future(
        run_cli("tool-call", "--thread-id", SESSION, "--tool", "count", "--args", retry_args, env=env)
    )
    await eventually(lambda: logged(caplog.records, JOINED) == 1)
    release(marker_dir, "cli-join")
    code, out, _ = await retry
    response = json.loads(out)
    assert code == 0 and response["ok"] is True and response["joined"] is True, out
    assert runs(marker_dir, "cli-join") == [response["toolRequestId"]]


async def test_retry_after_finish_before_delivery_replays(client: InvocationClient, marker_dir: Path) -> None:
    first = await count(client, "replay", 0.4, timeout=0.1)
    assert first.outcome is None and first.code is Code.CALLER_DEADLINE_EXCEEDED
    [request_id] = await eventually(lambda: runs(marker_dir, "replay"))

    async def completed() -> bool:
        record = await client.get_invocation(request_id)
        return record.state is InvocationState.COMPLETED

    await eventually(completed)  # the handler has finished; nobody has the outcome
    assert len(runs(marker_dir, "replay")) == 1
    retry = await count(client, "replay", 0.4)
    assert retry.replayed is True
    assert result_of(retry)["runs"] == 1
    assert runs(marker_dir, "replay") == [retry.tool_request_id]


async def test_confirmed_result_is_not_a_dedupe_cache(client: InvocationClient, marker_dir: Path) -> None:
    first = await count(client, "again")
    second = await count(client, "again")
    assert first.tool_request_id != second.tool_request_id
    assert not second.joined and not second.replayed
    assert result_of(second)["runs"] == 2


async def test_unconfirmed_result_replays_only_within_the_window(
    client: InvocationClient, marker_dir: Path
) -> None:
    first = await count(client, "window", confirm_delivery=False)
    assert (await count(client, "window", confirm_delivery=False)).replayed is True
    await asyncio.sleep(1.3)  # the replay window is 1 s in this suite
    with pytest.raises(grpc.aio.AioRpcError) as raised:  # then 1 s of "too late", nothing run
        await count(client, "window")
    assert error_code(raised.value) is Code.RETRY_WINDOW_PASSED
    assert raised.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert len(runs(marker_dir, "window")) == 1
    await asyncio.sleep(1.0)  # past the notice: the ledger has forgotten the call
    later = await count(client, "window")
    assert later.tool_request_id != first.tool_request_id and not later.replayed
    assert len(runs(marker_dir, "window")) == 2


async def test_a_lost_timeout_replays_within_the_window_then_says_the_window_passed(
    client: InvocationClient, marker_dir: Path
) -> None:
    """The caller gives up; the tool's deadline passes (TOOL_TIMEOUT, a side effect may have
    happened). An exact retry inside the window replays it; one after it is refused as too late,
    never run again: one execution throughout."""
    arguments = {"key": "lost-timeout", "sleep": 1.5}
    gave_up = await client.invoke(SESSION, "count_short", arguments, turn_id="turn", timeout=0.3)
    assert gave_up.outcome is None and gave_up.code is Code.CALLER_DEADLINE_EXCEEDED
    assert gave_up.tool_request_id is not None and gave_up.retry_safe_until is not None
    safe_until = datetime.datetime.fromisoformat(gave_up.retry_safe_until).timestamp()
    assert time.time() < safe_until <= time.time() + 1.0  # the suite's 1 s window, from the claim
    assert gave_up.to_json()["retrySafeUntil"] == gave_up.retry_safe_until

    async def timed_out() -> bool:
        record = await client.get_invocation(gave_up.tool_request_id or "")
        return record.state is InvocationState.TIMED_OUT

    await eventually(timed_out)
    retry = await client.invoke(SESSION, "count_short", arguments, turn_id="turn", confirm_delivery=False)
    assert retry.replayed and retry.tool_request_id == gave_up.tool_request_id
    assert retry.outcome is not None and retry.outcome.code == "TOOL_TIMEOUT"
    await asyncio.sleep(1.2)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client.invoke(SESSION, "count_short", arguments, turn_id="turn")
    assert error_code(raised.value) is Code.RETRY_WINDOW_PASSED
    info = error_info(raised.value)
    assert info is not None and info.metadata["toolRequestId"] == gave_up.tool_request_id
    assert info.metadata["state"] == "timed_out"
    await asyncio.sleep(1.0)  # let the handler's own sleep end: still one execution
    assert runs(marker_dir, "lost-timeout") == [gave_up.tool_request_id]


async def test_different_arguments_are_different_calls(client: InvocationClient, marker_dir: Path) -> None:
    one, two = await asyncio.gather(count(client, "diff-a", 0.2), count(client, "diff-b", 0.2))
    assert one.tool_request_id != two.tool_request_id


async def test_idempotency_key_returns_the_same_outcome(client: InvocationClient, marker_dir: Path) -> None:
    first = await count(client, "idem", idempotency_key="order-42")
    again = await count(client, "idem", idempotency_key="order-42")  # after confirmed delivery
    assert again.tool_request_id == first.tool_request_id and again.replayed
    assert runs(marker_dir, "idem") == [first.tool_request_id]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await count(client, "idem-other", idempotency_key="order-42")
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error_code(raised.value) is Code.IDEMPOTENCY_KEY_REUSED
    assert runs(marker_dir, "idem-other") == []


async def test_received_timeout_ends_the_invocation(client: InvocationClient, marker_dir: Path) -> None:
    first = await client.invoke(SESSION, "count_short", {"key": "timeout", "sleep": 1.5}, turn_id="turn")
    assert first.outcome is not None and first.outcome.code == "TOOL_TIMEOUT"
    record = await client.get_invocation(first.tool_request_id or "")
    assert record.state is InvocationState.TIMED_OUT and record.delivered
    second = await client.invoke(SESSION, "count_short", {"key": "timeout", "sleep": 0}, turn_id="turn")
    assert second.tool_request_id != first.tool_request_id
    assert result_of(second)["runs"] == 2


async def test_get_invocation_reconciles(
    client: InvocationClient, marker_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="toolmesh.invocation")
    pending = asyncio.ensure_future(held(client, "lookup", confirm_delivery=False))
    await eventually(lambda: runs(marker_dir, "lookup"))  # it runs
    # The retry joins; its id names the running invocation.
    joined = asyncio.ensure_future(held(client, "lookup", confirm_delivery=False))
    await eventually(lambda: logged(caplog.records, JOINED) == 1)
    release(marker_dir, "lookup")
    first = await pending
    assert first.tool_request_id is not None
    assert (await joined).joined
    record = await client.get_invocation(first.tool_request_id)
    assert record.state is InvocationState.COMPLETED
    assert record.delivered is False
    assert record.outcome is not None and first.outcome is not None
    assert record.outcome.result_json == first.outcome.result_json
    assert record.finished_at is not None and record.finished_at >= record.created_at
    await client.confirm_delivery(first.tool_request_id)
    assert (await client.get_invocation(first.tool_request_id)).delivered is True
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client.get_invocation("tr_unknown")
    assert error_code(raised.value) is Code.INVOCATION_NOT_FOUND


async def test_another_caller_s_confirmation_does_not_make_a_retry_run_again(
    ledger_system: LocalSystem, host: HostProcess, marker_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Caller A gives up; caller B sends the identical call, joins, gets the outcome and confirms
    it; A's exact retry replays that outcome: one run."""
    caplog.set_level(logging.INFO, logger="toolmesh.invocation")
    target = ledger_system.invocation_target
    async with InvocationClient(target) as a, InvocationClient(target, multiplex=True) as b:
        gave_up = await held(a, "a-and-b", timeout=0.5)
        assert gave_up.outcome is None and gave_up.code is Code.CALLER_DEADLINE_EXCEEDED
        # The service named the invocation and A's attachment ahead of the outcome.
        assert gave_up.tool_request_id is not None and gave_up.attachment_id is not None
        joining = asyncio.ensure_future(held(b, "a-and-b"))
        await eventually(lambda: logged(caplog.records, JOINED) == 1)
        release(marker_dir, "a-and-b")
        joined = await joining
        assert joined.joined and joined.tool_request_id == gave_up.tool_request_id
        assert joined.attachment_id not in (None, gave_up.attachment_id)
        await b.flush_confirmations()
        record = await a.get_invocation(gave_up.tool_request_id)
        assert record.delivered is False  # A has not confirmed
        retry = await held(a, "a-and-b")
        assert retry.replayed and retry.tool_request_id == gave_up.tool_request_id
        assert result_of(retry)["runs"] == 1
        assert runs(marker_dir, "a-and-b") == [gave_up.tool_request_id]
        # A confirms its retry's attachment and its first call's: now an identical call runs anew.
        await a.flush_confirmations()
        assert (await a.get_invocation(gave_up.tool_request_id)).delivered is True
        later = await held(a, "a-and-b")
        assert not later.replayed and later.tool_request_id != gave_up.tool_request_id


async def test_a_confirmation_names_a_whole_invocation_or_one_attachment(
    ledger_system: LocalSystem, host: HostProcess
) -> None:
    async with (
        InvocationClient(ledger_system.invocation_target) as client,
        grpc.aio.insecure_channel(ledger_system.invocation_target) as channel,
    ):
        stub = invocation_pb2_grpc.InvocationServiceStub(channel)
        first = await count(client, "whole", confirm_delivery=False)
        replayed = await count(client, "whole", confirm_delivery=False)
        assert replayed.replayed and first.tool_request_id is not None
        # The id alone (the form without attachments) confirms every caller's attachment.
        await stub.ConfirmDelivery(
            invocation_pb2.ConfirmDeliveryRequest(tool_request_ids=[first.tool_request_id])
        )
        assert (await client.get_invocation(first.tool_request_id)).delivered is True
        # An attachment must be named: an empty one is not taken for "every attachment".
        unnamed = invocation_pb2.DeliveredAttachment(tool_request_id=first.tool_request_id)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ConfirmDelivery(invocation_pb2.ConfirmDeliveryRequest(attachments=[unnamed]))
        assert error_code(raised.value) is Code.INVALID_REQUEST
        too_many = [invocation_pb2.DeliveredAttachment(tool_request_id="tr_x", attachment_id="1")] * 501
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.ConfirmDelivery(
                invocation_pb2.ConfirmDeliveryRequest(tool_request_ids=["tr_x"] * 500, attachments=too_many)
            )
        assert error_code(raised.value) is Code.INVALID_REQUEST


async def test_cli_shows_an_invocation(
    client: InvocationClient, ledger_system: LocalSystem, cli_env: dict[str, str], backend: str
) -> None:
    call = await count(client, "cli-show")
    await client.flush_confirmations()
    env = dict(cli_env, TOOLMESH_INVOCATION_ADDR=ledger_system.invocation_target)
    code, out, _ = await run_cli("invocations", "show", call.tool_request_id or "", env=env)
    shown = json.loads(out)
    assert code == 0
    assert shown["state"] == "completed" and shown["delivered"] is True and shown["toolName"] == "count"
    # Its host acknowledged its start; the bridge fences starts in a ledger it shares (not in memory).
    assert ("startedAt" in shown) is (backend != MEMORY)
    if backend != MEMORY:
        created, started, finished = (
            datetime.datetime.fromisoformat(shown[name]) for name in ("createdAt", "startedAt", "finishedAt")
        )
        assert created <= started <= finished
    code, _, err = await run_cli("invocations", "show", "tr_missing", env=env)
    assert code == 1 and "INVOCATION_NOT_FOUND" in err


@pytest.mark.parametrize(("tool", "redelivered"), [("count_read_only", True), ("count", False)])
async def test_host_lost_mid_call(
    ledger_system: LocalSystem, marker_dir: Path, tool: str, redelivered: bool
) -> None:
    session = f"lost-{tool}"
    async with RegistryClient(ledger_system.registry_target) as registry:
        await registry.put_tools(session, TOOLS)
    first_host = await start_host_process(
        ledger_system.bridge_target, session, "ledger_handlers:HANDLERS", marker_dir
    )
    key = f"lost-{tool}"
    async with InvocationClient(ledger_system.invocation_target) as client:
        call = asyncio.ensure_future(client.invoke(session, tool, {"key": key, "hold": 1}, turn_id="turn"))
        await eventually(lambda: runs(marker_dir, key))
        first_host.kill()
        await first_host.stop()
        release(marker_dir, key)  # a redelivered call runs to the end on the next host
        second_host = await start_host_process(
            ledger_system.bridge_target, session, "ledger_handlers:HANDLERS", marker_dir
        )
        result = await asyncio.wait_for(call, 10)
        await second_host.stop()
    assert result.outcome is not None
    if redelivered:
        assert result_of(result)["runs"] == 2
        assert result_of(result)["servedBy"] == second_host.process.pid
    else:
        assert result.outcome.code == "TOOL_HOST_DISCONNECTED"
        assert result.outcome.failure is not None and result.outcome.failure.retryable is False
        assert len(runs(marker_dir, key)) == 1
