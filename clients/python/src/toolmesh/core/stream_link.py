"""A long-lived bidi stream carrying many requests, each answered once by a result with its key.

Both of toolmesh's multiplexed streams (calls to the invocation service,
dispatches to the bridge) work this way: whatever is ready goes out together
(an Outbox), results settle the futures waiting on them, and when the stream
ends every waiter still open fails with StreamBroken. A link that has ended
stays ended: open a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

import grpc

from toolmesh.core.outbox import Outbox

Item = TypeVar("Item")
Message = TypeVar("Message")
Response = TypeVar("Response")
Result = TypeVar("Result")


class StreamBroken(Exception):
    """The stream ended before the result arrived; `status` is the gRPC status name, `error` the
    failed call when the stream ended with one (a refused token, a lost connection)."""

    def __init__(self, status: str, error: grpc.aio.AioRpcError | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.error = error


class StreamLink(Generic[Item, Message, Response, Result]):
    def __init__(
        self,
        open_stream: Callable[[AsyncIterator[Message]], Any],
        *,
        batch: Callable[[list[Item]], Message],
        size_of: Callable[[Item], int],
        results_of: Callable[[Response], Iterable[Result]],
        key_of: Callable[[Result], Hashable],
        on_response: Callable[[Response], None] | None = None,
        in_flight: Callable[[Hashable], bool] = lambda key: True,
    ) -> None:
        """`on_response` sees each response before its results settle: for what else it carries.

        `in_flight`: whether a result awaited with this key counts as a call in flight, one that
        says others are on their way (by default every one does).
        """
        # Other calls in flight on the link: a send waits a few turns of the loop for theirs (Outbox).
        self._outbox: Outbox[Item] = Outbox(
            size_of, more_coming=lambda: len(self._in_flight) > len(self._outbox)
        )
        self._counts = in_flight
        # The keys awaited that count as calls in flight.
        self._in_flight: set[Hashable] = set()
        self._on_response = on_response
        self._batch = batch
        self._results_of = results_of
        self._key_of = key_of
        self._waiting: dict[Hashable, asyncio.Future[Result]] = {}
        self.closed = False
        # True once the other end's first response came, False if the stream ended before one.
        self.spoke: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._call = open_stream(self._messages())
        self._reader = asyncio.create_task(self._read())

    def send(self, item: Item) -> None:
        self._outbox.put(item)

    def expect(self, key: Hashable) -> asyncio.Future[Result]:
        """A future for the result with `key`; StreamBroken if the stream ends first."""
        result: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiting[key] = result
        if self._counts(key):
            self._in_flight.add(key)
        return result

    def forget(self, key: Hashable) -> bool:
        """Stop waiting for `key` (a late result is dropped); whether it was still awaited."""
        self._in_flight.discard(key)
        return self._waiting.pop(key, None) is not None

    async def finish(self, timeout: float) -> None:
        """Send what is queued, end the sending side, and give the other end up to `timeout` to
        answer all and end the stream; then close it as `aclose` does. No send goes out after."""
        self.closed = True
        self._outbox.close()
        await asyncio.wait({self._reader}, timeout=timeout)
        await self.aclose()

    async def aclose(self) -> None:
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def _messages(self) -> AsyncIterator[Message]:
        # Ends once the stream has (the outbox closed): gRPC's task reading it would otherwise wait
        # here for ever, and be destroyed pending when the call is dropped.
        while items := await self._outbox.take():
            yield self._batch(items)

    async def _read(self) -> None:
        ended = "OK"
        failure: grpc.aio.AioRpcError | None = None
        try:
            async for response in self._call:
                if not self.spoke.done():
                    self.spoke.set_result(True)
                if self._on_response is not None:
                    self._on_response(response)
                for result in self._results_of(response):
                    key = self._key_of(result)
                    self._in_flight.discard(key)
                    waiting = self._waiting.pop(key, None)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(result)
        except grpc.aio.AioRpcError as error:
            ended = error.code().name
            failure = error
        except asyncio.CancelledError:
            ended = "CANCELLED"
            raise
        finally:
            self.closed = True
            if not self.spoke.done():
                self.spoke.set_result(False)
            self._outbox.clear()
            self._outbox.close()
            waiting_ones, self._waiting = self._waiting, {}
            self._in_flight.clear()
            for waiting in waiting_ones.values():
                if not waiting.done():
                    waiting.set_exception(StreamBroken(ended, failure))
