"""Helpers for the tests of limits and quotas: settings, services started with them, silent hosts."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.core.errors import Code
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.v1 import bridge_pb2, tool_pb2

OBJECT = '{"type": "object"}'


def limits(**settings: int) -> Limits:
    return dataclasses.replace(DEFAULT_LIMITS, **settings)


def status_of(
    raised: pytest.ExceptionInfo[grpc.aio.AioRpcError],
) -> tuple[grpc.StatusCode, Code | None, dict[str, str]]:
    info = error_info(raised.value)
    return raised.value.code(), error_code(raised.value), dict(info.metadata) if info else {}


@contextlib.asynccontextmanager
async def system_with(settings: Limits, **options: Any) -> AsyncIterator[LocalSystem]:
    system = await start_local_system(limits=settings, **options)
    try:
        yield system
    finally:
        await system.stop(0.5)


def tool(name: str, schema: str = OBJECT, timeout_ms: int = 5000) -> tool_pb2.ToolDefinition:
    return tool_pb2.ToolDefinition(name=name, input_schema_json=schema, timeout_ms=timeout_ms)


class SilentHost:
    """A raw host session that takes requests and never answers them (calls wait on it)."""

    def __init__(self, stub: Any, session: str, metadata: Any = None) -> None:
        self.stream = stub.OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(
                session_id=session, host_name="silent", has_generic_handler=True
            ),
            metadata=metadata,
        )
        self.requests = 0
        self.host_session_id = ""
        self._reader: asyncio.Task[None] | None = None

    async def open(self) -> SilentHost:
        async for event in self.stream:
            if event.WhichOneof("event") == "opened":
                self.host_session_id = event.opened.host_session_id
                break
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def _read(self) -> None:
        async for event in self.stream:
            if event.WhichOneof("event") == "tool_request":
                self.requests += 1

    def close(self) -> None:
        self.stream.cancel()
        if self._reader is not None:
            self._reader.cancel()
