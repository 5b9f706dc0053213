"""The registry's domain: each session's tool list and its revision, kept in a Store."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.names import require_id, require_tool_name
from toolmesh.core.tools import ToolAnnotations, ToolSet, ToolSpec
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.rules.tool_lists import check_tools
from toolmesh.store.base import Store, VersionConflict, Versioned


def _key(session_id: str) -> str:
    return f"registry:tools:{session_id}"


def encode_tools(tools: Sequence[ToolSpec]) -> bytes:
    records = [
        {
            "name": tool.name,
            "description": tool.description,
            "input": tool.input_schema_json,
            "output": tool.output_schema_json,
            "timeoutMs": tool.timeout_ms,
            "flags": [
                tool.annotations.read_only,
                tool.annotations.idempotent,
                tool.annotations.requires_confirmation,
            ],
        }
        for tool in tools
    ]
    return json.dumps(records, separators=(",", ":")).encode()


def _decode(stored: Versioned | None) -> ToolSet:
    if stored is None:
        return ToolSet(0)
    records = json.loads(stored.value)
    return ToolSet(
        stored.version,
        tuple(
            ToolSpec(
                name=record["name"],
                description=record["description"],
                input_schema_json=record["input"],
                output_schema_json=record["output"],
                timeout_ms=record["timeoutMs"],
                annotations=ToolAnnotations(*record["flags"]),
            )
            for record in records
        ),
    )


class Registry:
    def __init__(self, store: Store, limits: Limits = DEFAULT_LIMITS) -> None:
        self._store = store
        self._limits = limits

    async def put_tools(
        self, session_id: str, tools: Sequence[ToolSpec], expected_revision: int | None = None
    ) -> int:
        require_id(session_id, "session_id")
        # In a thread: checking a list of large schemas takes milliseconds per tool, and the
        # event loop goes on serving other sessions meanwhile.
        await asyncio.to_thread(check_tools, tools, self._limits)
        encoded = encode_tools(tools)
        if len(encoded) > self._limits.registry_bytes_per_session:
            raise self._limits.over(
                "registry_bytes_per_session",
                f"A session's tools take at most {self._limits.registry_bytes_per_session} bytes.",
            )
        current = await self._store.get(_key(session_id))
        current_revision = 0 if current is None else current.version
        if expected_revision is not None and expected_revision != current_revision:
            raise _conflict(session_id, expected_revision, current_revision)
        if current is not None and current.value == encoded:
            return current.version  # nothing changed, so the revision stays
        try:
            return await self._store.put(_key(session_id), encoded, expected_version=current_revision)
        except VersionConflict as conflict:
            if expected_revision is not None:
                raise _conflict(session_id, expected_revision, conflict.actual) from None
            # A concurrent put won the race; ours replaces it (last writer wins).
            return await self._store.put(_key(session_id), encoded)

    async def list_tools(self, session_id: str) -> ToolSet:
        require_id(session_id, "session_id")
        return _decode(await self._store.get(_key(session_id)))

    async def get_tool(self, session_id: str, name: str) -> tuple[int, ToolSpec]:
        require_tool_name(name)
        tools = await self.list_tools(session_id)
        tool = tools.find(name)
        if tool is None:
            raise ToolmeshError(Code.TOOL_NOT_FOUND, "", {"sessionId": session_id, "tool": name})
        return tools.revision, tool

    async def watch(self, session_id: str) -> AsyncIterator[ToolSet]:
        require_id(session_id, "session_id")
        async for stored in self._store.watch(_key(session_id)):
            yield _decode(stored)


def _conflict(session_id: str, expected: int, actual: int) -> ToolmeshError:
    return ToolmeshError(
        Code.REVISION_CONFLICT,
        f"Expected revision {expected}, current is {actual}.",
        {"sessionId": session_id, "expectedRevision": str(expected), "revision": str(actual)},
    )
