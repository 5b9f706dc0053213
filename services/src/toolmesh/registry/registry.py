"""The registry's domain: each session's tool list and its revision, kept in a Store."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.names import require_id, require_tool_name
from toolmesh.core.tools import ToolAnnotations, ToolSet, ToolSpec
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.rules.shares import Shares
from toolmesh.rules.tool_lists import check_tools
from toolmesh.store.base import Store, VersionConflict, Versioned

# Whose share a stored list counts against (a grant key, None without one), and its bytes.
_Holding = tuple[str | None, int]


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
    """Each session's tools. `grant` (the caller's token subject, None without one) is whose share
    a put list's bytes and an open watch count against, in this replica's memory."""

    def __init__(self, store: Store, limits: Limits = DEFAULT_LIMITS) -> None:
        self._store = store
        self._limits = limits
        self._bytes = Shares(limits, "registry_bytes", "registry_bytes_per_grant", what="bytes of tool lists")
        self._watches = Shares(limits, "watches", "watches_per_grant", what="watches")
        # The bytes of each session's list put here, and whose share they count against.
        self._stored: dict[str, _Holding] = {}

    async def put_tools(
        self,
        session_id: str,
        tools: Sequence[ToolSpec],
        expected_revision: int | None = None,
        *,
        grant: str | None = None,
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
        prior = self._count(session_id, (grant, len(encoded)))
        try:
            return await self._put(session_id, encoded, expected_revision)
        except BaseException:
            self._count(session_id, prior)
            raise

    def _count(self, session_id: str, holding: _Holding | None) -> _Holding | None:
        """Count the session's list as `holding` (its grant and bytes; None: none) instead of what
        it was, which is returned. Raises QUOTA_EXCEEDED / OVERLOADED, counting nothing, when the
        grant's share or this replica's bound cannot take it."""
        prior = self._stored.pop(session_id, None)
        if prior is not None:
            self._bytes.give_back(*prior)
        if holding is None:
            return prior
        try:
            self._bytes.take(*holding)
        except ToolmeshError:
            if prior is not None:
                self._bytes.take(*prior)  # it was held a moment ago: it fits
                self._stored[session_id] = prior
            raise
        self._stored[session_id] = holding
        return prior

    async def _put(self, session_id: str, encoded: bytes, expected_revision: int | None) -> int:
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

    async def watch(self, session_id: str, grant: str | None = None) -> AsyncGenerator[ToolSet, None]:
        require_id(session_id, "session_id")
        self._watches.take(grant)
        try:
            async for stored in self._store.watch(_key(session_id)):
                yield _decode(stored)
        finally:
            self._watches.give_back(grant)


def _conflict(session_id: str, expected: int, actual: int) -> ToolmeshError:
    return ToolmeshError(
        Code.REVISION_CONFLICT,
        f"Expected revision {expected}, current is {actual}.",
        {"sessionId": session_id, "expectedRevision": str(expected), "revision": str(actual)},
    )
