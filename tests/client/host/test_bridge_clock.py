"""A host bounds the bridge's clock from the bridge's answers, so a request's deadline is never later
on the host's clock than on the bridge's: a host never starts a request whose caller was told
TOOL_TIMEOUT, however late it read the bridge's answers."""

from __future__ import annotations

import time

import pytest

from toolmesh.host.engine import _Stream
from toolmesh.v1 import bridge_pb2

pytestmark = pytest.mark.unit


def wall_ms() -> int:
    return int(time.time() * 1000)


def request(deadline_unix_ms: int, timeout_ms: int = 60_000) -> bridge_pb2.ToolRequest:
    return bridge_pb2.ToolRequest(
        tool_request_id="tr_1", timeout_ms=timeout_ms, deadline_unix_ms=deadline_unix_ms
    )


def on_host_clock(deadline_unix_ms: int) -> float:
    """The instant of `deadline_unix_ms` on time.monotonic() (one machine: one wall clock)."""
    return time.monotonic() + (deadline_unix_ms - time.time() * 1000) / 1000


def test_a_deadline_is_never_later_than_the_bridges_however_late_the_opening_was_read() -> None:
    # The bridge answered at once; this process read the answer 80 ms later (a pause, a busy loop).
    asked_at = time.monotonic() - 0.080
    stream = _Stream(asked_at)
    stream.answered(int((asked_at - time.monotonic()) * 1000) + wall_ms(), asked_at)
    deadline_unix_ms = wall_ms() + 5_000
    assert stream.deadline_of(request(deadline_unix_ms)) <= on_host_clock(deadline_unix_ms) + 0.001


def test_a_request_whose_deadline_may_have_passed_counts_as_past_it() -> None:
    # Asked 50 ms ago, answered now: the bridge's clock is known to within 50 ms, so a deadline
    # 30 ms ahead on it may already be behind on this process's clock.
    stream = _Stream(time.monotonic() - 0.050)
    stream.answered(wall_ms(), stream.asked_at)
    assert stream.deadline_of(request(wall_ms() + 30)) <= time.monotonic()


def test_a_quicker_answer_narrows_the_bound() -> None:
    stream = _Stream(time.monotonic() - 0.050)
    stream.answered(wall_ms(), stream.asked_at)
    stream.answered(wall_ms(), time.monotonic())
    deadline_unix_ms = wall_ms() + 30
    deadline = stream.deadline_of(request(deadline_unix_ms))
    assert time.monotonic() < deadline <= on_host_clock(deadline_unix_ms) + 0.001


def test_a_slower_answer_does_not_widen_it() -> None:
    stream = _Stream(time.monotonic())
    stream.answered(wall_ms(), stream.asked_at)
    stream.answered(wall_ms(), time.monotonic() - 0.050)
    assert stream.deadline_of(request(wall_ms() + 30)) > time.monotonic()


def test_without_the_bridges_clock_the_timeout_counts_from_reading() -> None:
    stream = _Stream(time.monotonic())
    stream.answered(0, stream.asked_at)  # a bridge that does not send its clock
    before = time.monotonic()
    deadline = stream.deadline_of(request(wall_ms() - 1_000, timeout_ms=2_000))
    assert before + 2 <= deadline <= time.monotonic() + 2


def test_a_deadline_never_comes_later_than_the_timeout_from_reading() -> None:
    stream = _Stream(time.monotonic())
    stream.answered(wall_ms(), stream.asked_at)
    assert stream.deadline_of(request(wall_ms() + 60_000, timeout_ms=1_000)) <= time.monotonic() + 1
