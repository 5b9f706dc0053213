"""Serving a multiplexed bidi stream: one task reads what comes in, the handler writes what goes out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol, TypeVar

In_contra = TypeVar("In_contra", contravariant=True)
Out_co = TypeVar("Out_co", covariant=True)


class Multiplexed(Protocol[In_contra, Out_co]):
    async def read(self, messages: AsyncIterator[In_contra]) -> None: ...

    def responses(self) -> AsyncIterator[Out_co]: ...

    def close(self) -> None:
        """The stream ended: give up on what it still holds."""
        ...


async def relay(
    stream: Multiplexed[In_contra, Out_co], messages: AsyncIterator[In_contra]
) -> AsyncIterator[Out_co]:
    """The stream's responses, while a task feeds it the incoming messages.

    When reading failed (a message that did not decode or broke the contract:
    the reader raises, and takes nothing after it), the responses still go out
    until everything taken is answered; then the stream fails with the reader's error.
    """
    reader = asyncio.create_task(stream.read(messages))
    try:
        async for response in stream.responses():
            yield response
    finally:
        reader.cancel()
        stream.close()
    if reader.done() and not reader.cancelled() and (error := reader.exception()) is not None:
        raise error
