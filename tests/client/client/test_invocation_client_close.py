"""A client closed while confirmations are still being made: a confirmation that comes after
close() is not sent (the channel is closed) and raises nothing, as any confirmation that cannot
go (the replay window covers it)."""

from __future__ import annotations

import pytest

from toolmesh.client import InvocationClient

pytestmark = pytest.mark.unit


async def test_a_confirmation_after_close_is_not_sent_and_raises_nothing() -> None:
    client = InvocationClient("127.0.0.1:9")  # nothing listens there: no call is ever made
    await client.close()
    assert await client.confirm_delivery("tr_after_close") is False
    await client.flush_confirmations()  # the same, from the pending list
