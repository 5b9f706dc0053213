"""When a stream link lets the event loop run before it takes what is queued: while calls are in
flight (their items are on their way), not for awaited results its owner says are not calls (a
receipt of a result already sent)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from typing import Any

import pytest

from toolmesh.core.outbox import GATHER_TURNS
from toolmesh.core.stream_link import StreamLink

pytestmark = pytest.mark.unit


class Turns:
    """Counts turns of the event loop."""

    def __init__(self) -> None:
        self.count = 0
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.count += 1

    def stop(self) -> None:
        self._task.cancel()


class Stream:
    """A stream that notes the turn each message went out on and answers nothing until cancelled."""

    def __init__(self, messages: AsyncIterator[list[str]], turns: Turns) -> None:
        self.sent: asyncio.Queue[tuple[list[str], int]] = asyncio.Queue()
        self._turns = turns
        self._ended = asyncio.Event()
        self._reading = asyncio.create_task(self._read(messages))

    async def _read(self, messages: AsyncIterator[list[str]]) -> None:
        async for message in messages:
            self.sent.put_nowait((message, self._turns.count))

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        await self._ended.wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self._ended.set()
        self._reading.cancel()


def link_with(turns: Turns, streams: list[Stream], **options: Any) -> StreamLink[str, list[str], Any, Any]:
    def open_stream(messages: AsyncIterator[list[str]]) -> Stream:
        streams.append(Stream(messages, turns))
        return streams[-1]

    return StreamLink(
        open_stream,
        batch=list,
        size_of=len,
        results_of=lambda response: [],
        key_of=lambda result: result,
        **options,
    )


async def turns_to_send(key: Hashable, **options: Any) -> int:
    """Turns of the loop between sending "next" and its message going out, while `key` (sent
    before, already out) is still awaited."""
    turns = Turns()
    streams: list[Stream] = []
    link = link_with(turns, streams, **options)
    try:
        link.expect(key)
        link.send("earlier")
        assert (await streams[0].sent.get())[0] == ["earlier"]
        link.expect("next")
        link.send("next")
        sent_at = turns.count
        message, went_at = await streams[0].sent.get()
        assert message == ["next"]
        return went_at - sent_at
    finally:
        turns.stop()
        await link.aclose()


async def test_an_item_waits_for_others_while_a_call_is_in_flight() -> None:
    assert await turns_to_send("earlier") >= GATHER_TURNS


async def test_an_item_goes_at_once_while_only_results_that_are_not_calls_are_awaited() -> None:
    assert await turns_to_send("receipt", in_flight=lambda key: key != "receipt") < GATHER_TURNS
