"""The progress of an invocation through the store, for callers that joined it on another replica."""

from __future__ import annotations

import asyncio

import pytest

from toolmesh.core.progress import ToolProgress
from toolmesh.invocation.progress_relay import ProgressRelay, progress_key
from toolmesh.store import slots
from toolmesh.store.base import Versioned
from toolmesh.store.memory import InMemoryStore
from toolmesh_testing import eventually

pytestmark = pytest.mark.unit

TOOL_REQUEST_ID = slots.tool_request_id("s1", "ab12")


def report(value: float) -> ToolProgress:
    return ToolProgress(TOOL_REQUEST_ID, value, 100, f"step {value:g}")


async def test_a_follower_gets_the_latest_report_and_each_later_one() -> None:
    store = InMemoryStore()
    owner, joiner = ProgressRelay(store, interval_s=0.01), ProgressRelay(store)
    owner.publish(report(1), 30)
    seen: list[ToolProgress] = []
    following = asyncio.create_task(joiner.follow(TOOL_REQUEST_ID, seen.append))
    await eventually(lambda: seen)
    owner.publish(report(2), 30)
    await eventually(lambda: seen[-1].progress == 2)
    following.cancel()
    assert seen == [report(1), report(2)]
    await owner.aclose()


async def test_writes_are_one_per_interval_at_most_the_latest_report() -> None:
    store = InMemoryStore()
    owner = ProgressRelay(store, interval_s=0.1)
    for value in range(1, 31):  # 30 reports 10 ms apart: 0.3 s
        owner.publish(report(value), 30)
        await asyncio.sleep(0.01)

    async def last_written() -> Versioned | None:
        written = await store.get(progress_key(TOOL_REQUEST_ID))
        return written if written is not None and written.value == b'[30,100,"step 30"]' else None

    # The last report is written, and no more than one write per 100 ms happened.
    written = await eventually(last_written)
    assert written.version <= 5, written.version
    await owner.aclose()


def test_the_key_of_an_invocation_s_progress_is_in_its_session_s_slot() -> None:
    tag = slots.hash_tag(slots.session_tag("s1"))
    assert slots.tagged_key(progress_key(TOOL_REQUEST_ID)) == f"invocation:progress:{tag}{TOOL_REQUEST_ID}"
    assert slots.tagged_key("invocation:progress:tr_untagged") == "invocation:progress:tr_untagged"
