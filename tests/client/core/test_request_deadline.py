"""The invocation's deadline folded into a dispatched request's timeout when the bridge reads it."""

from __future__ import annotations

import time

import pytest

from toolmesh.core.wire import request_from_pb, time_left_ms
from toolmesh.v1 import bridge_pb2

pytestmark = pytest.mark.unit


def dispatched(timeout_ms: int, invocation_deadline_unix_ms: int = 0) -> bridge_pb2.ToolRequest:
    return bridge_pb2.ToolRequest(
        session_id="s",
        turn_id="t",
        tool_request_id="tr_1",
        tool_name="count",
        arguments_json="{}",
        timeout_ms=timeout_ms,
        invocation_deadline_unix_ms=invocation_deadline_unix_ms,
    )


def now_ms() -> int:
    return int(time.time() * 1000)


def test_an_older_invocation_service_without_it_keeps_the_whole_timeout() -> None:
    assert time_left_ms(request_from_pb(dispatched(5_000))) == 5_000


def test_a_request_read_late_gets_only_the_time_left_until_the_invocations_deadline() -> None:
    left = time_left_ms(request_from_pb(dispatched(5_000, now_ms() + 2_000)))
    assert 1_000 < left <= 2_000


def test_a_deadline_later_than_the_timeout_does_not_lengthen_it() -> None:
    assert time_left_ms(request_from_pb(dispatched(5_000, now_ms() + 60_000))) == 5_000


@pytest.mark.parametrize("ago_ms", [0, 1, 30_000])
def test_a_request_read_past_the_invocations_deadline_has_no_time_left(ago_ms: int) -> None:
    assert time_left_ms(request_from_pb(dispatched(5_000, now_ms() - ago_ms))) == 0
