"""toolmesh.core.deadlines: many deadlines on one timer, each at its own time, on both loops."""

from __future__ import annotations

import asyncio

import pytest

from toolmesh.core.deadlines import Deadlines
from toolmesh_testing import LOOPS, run_on

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("loop", LOOPS)
def test_each_expires_at_its_own_time_in_order_and_a_discarded_one_never(loop: str) -> None:
    async def main() -> list[tuple[str, float]]:
        running = asyncio.get_running_loop()
        started = running.time()
        expired: list[tuple[str, float]] = []
        done = asyncio.Event()

        def expire(key: str) -> None:
            expired.append((key, running.time() - started))
            if key == "last":
                done.set()

        deadlines: Deadlines[str] = Deadlines(expire)
        for key, delay in (("c", 0.06), ("a", 0.02), ("gone", 0.03), ("b", 0.04), ("last", 0.1)):
            deadlines.add(key, delay)
        deadlines.discard("gone")
        assert len(deadlines) == 4 and "gone" not in deadlines
        await done.wait()
        assert len(deadlines) == 0
        return expired

    expired = run_on(loop, main())
    assert [key for key, _ in expired] == ["a", "b", "c", "last"]
    for (_, at), due in zip(expired, (0.02, 0.04, 0.06, 0.1), strict=True):
        assert at >= due - 0.0011  # never early beyond the clock's millisecond


@pytest.mark.parametrize("loop", LOOPS)
def test_added_again_only_the_new_deadline_counts(loop: str) -> None:
    async def main() -> list[str]:
        expired: list[str] = []
        deadlines: Deadlines[str] = Deadlines(expired.append)
        deadlines.add("moved", 0.01)
        deadlines.add("moved", 0.05)
        deadlines.add("marker", 0.03)
        await asyncio.sleep(0.035)
        first = list(expired)
        await asyncio.sleep(0.03)
        return [*first, "|", *expired]

    assert run_on(loop, main()) == ["marker", "|", "marker", "moved"]


@pytest.mark.parametrize("loop", LOOPS)
def test_discarded_entries_do_not_pile_up_and_the_last_discard_drops_the_timer(loop: str) -> None:
    async def main() -> tuple[int, bool]:
        deadlines: Deadlines[int] = Deadlines(lambda key: None)
        for key in range(1000):
            deadlines.add(key, 60)
        for key in range(990):
            deadlines.discard(key)
        held = len(deadlines._heap)
        for key in range(990, 1000):
            deadlines.discard(key)
        return held, deadlines._timer is None

    held, timer_gone = run_on(loop, main())
    assert held <= 2 * 10 + 64
    assert timer_gone


@pytest.mark.parametrize("loop", LOOPS)
def test_one_that_raises_stops_none_of_the_others(loop: str) -> None:
    async def main() -> tuple[list[str], list[str]]:
        running = asyncio.get_running_loop()
        reported: list[str] = []
        running.set_exception_handler(lambda _, context: reported.append(type(context["exception"]).__name__))
        expired: list[str] = []

        def expire(key: str) -> None:
            if key == "bad":
                raise RuntimeError("boom")
            expired.append(key)

        deadlines: Deadlines[str] = Deadlines(expire)
        for key in ("bad", "good", "other"):
            deadlines.add(key, 0.01)
        await asyncio.sleep(0.05)
        return expired, reported

    assert run_on(loop, main()) == (["good", "other"], ["RuntimeError"])


@pytest.mark.parametrize("loop", LOOPS)
def test_close_forgets_every_deadline(loop: str) -> None:
    async def main() -> list[str]:
        expired: list[str] = []
        deadlines: Deadlines[str] = Deadlines(expired.append)
        deadlines.add("a", 0.01)
        deadlines.close()
        await asyncio.sleep(0.03)
        return expired

    assert run_on(loop, main()) == []


@pytest.mark.parametrize("loop", LOOPS)
def test_a_key_discarded_by_an_earlier_expiry_of_the_same_moment_does_not_expire(loop: str) -> None:
    async def main() -> list[str]:
        expired: list[str] = []

        def expire(key: str) -> None:
            expired.append(key)
            deadlines.discard("second")  # as the bridge ends another request on an expiry

        deadlines: Deadlines[str] = Deadlines(expire)
        deadlines.add("first", 0.01)
        deadlines.add("second", 0.01)
        await asyncio.sleep(0.05)
        return expired

    assert run_on(loop, main()) == ["first"]
