"""A stream link whose stream breaks: its waiters fail with StreamBroken, and it leaves nothing behind
(no task of gRPC's left waiting for the next message, to be destroyed pending later)."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from toolmesh.core.stream_link import StreamBroken, StreamLink

pytestmark = pytest.mark.integration

METHOD = "/test.Breaks/Stream"


async def breaks(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """Takes one message, then ends the stream with an error (a replica going away)."""
    async for _ in requests:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")


async def test_a_broken_stream_fails_its_waiters_and_leaves_no_task_pending(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = grpc.aio.server()
    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.stream_stream_rpc_method_handler(breaks)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("test.Breaks", {"Stream": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            link: StreamLink[bytes, bytes, bytes, bytes] | None = StreamLink(
                channel.stream_stream(METHOD),  # type: ignore[arg-type]  # untyped bytes in, bytes out
                batch=b"".join,
                size_of=len,
                results_of=lambda response: [response],
                key_of=lambda result: result,
            )
            assert link is not None
            waiting = link.expect(b"a")
            link.send(b"a")
            with pytest.raises(StreamBroken) as broken:
                await asyncio.wait_for(waiting, 5)
            assert broken.value.status == "UNAVAILABLE" and link.closed
            await asyncio.sleep(0.1)
            # Dropped, as a client drops a broken link for a new one (the failure's traceback holds it).
            link = None
            del waiting, broken
            for _ in range(3):
                gc.collect()
                await asyncio.sleep(0.01)
        destroyed = [
            r for r in caplog.records if r.getMessage().startswith("Task was destroyed but it is pending")
        ]
        assert destroyed == []
    finally:
        await channel.close()
        await server.stop(0)
