"""An invocation's times on the wire are whole milliseconds, the grain of its start mark (the
store's clock), so none reads as later than a time after it: created within the millisecond its
start was marked in showed as after its start (CI: createdAt ...323001 against startedAt ...323000)."""

from __future__ import annotations

import pytest

from toolmesh.invocation.messages import timestamp

pytestmark = pytest.mark.unit


def test_times_are_whole_milliseconds_rounded_down_and_keep_their_order() -> None:
    created, started, finished = 1796429373.323001, 1796429373323 / 1000, 1796429373.3239
    stamps = [timestamp(at).ToMilliseconds() for at in (created, started, finished)]
    assert stamps == [1796429373323] * 3
    assert all(timestamp(at).nanos % 1_000_000 == 0 for at in (created, started, finished))
    # A start mark in whole milliseconds comes back exactly, despite the float.
    assert timestamp(1796429373322 / 1000).ToMilliseconds() == 1796429373322
