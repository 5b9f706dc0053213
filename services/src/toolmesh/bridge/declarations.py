"""Tools that connected hosts declare, kept in their sessions' lists in the registry.

A host (a web page above all) brings its own tool definitions: DeclareHostTools
replaces what that host declares. Per session, the bridge wants every tool its
connected hosts declare (on a name declared twice, the host that declared last
wins) and wants the tools a host withdrew gone. It merges that into the
session's list by name, leaving the tools others put alone, with a
compare-and-set on the revision. A keeper per session watches the list while
hosts declare into it and puts the tools back whenever the list loses them (a
registry that restarted empty, a PutTools that left them out). A host that
goes away leaves its tools listed, so a call then ends with
TOOL_HOST_UNAVAILABLE (nothing ran) rather than TOOL_NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Container, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from toolmesh.bridge.router import HostSession, Router
from toolmesh.core.backoff import Backoff
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.rules.shares import Shares
from toolmesh.rules.tool_lists import check_tools, tools_bytes

log = logging.getLogger("toolmesh.bridge")

# Concurrent writers to one session's list make a put fail its revision check;
# after this many tries in a row the declaration waits for the keeper.
_PUT_ATTEMPTS = 8


class ToolLists(Protocol):
    """The registry's session lists, as the bridge uses them.

    Each method raises ToolmeshError: REVISION_CONFLICT, INVALID_SCHEMA or
    INVALID_REQUEST as the registry says, REGISTRY_UNAVAILABLE when it does
    not answer (a watch raises it when its stream breaks).
    """

    async def get(self, session_id: str) -> ToolSet: ...

    async def put(self, session_id: str, tools: Sequence[ToolSpec], expected_revision: int) -> int: ...

    def watch(self, session_id: str) -> AsyncIterator[ToolSet]: ...


@dataclass(eq=False)
class _Session:
    # Declarations by host session id, oldest first: a later host wins a name.
    hosts: dict[str, tuple[ToolSpec, ...]] = field(default_factory=dict)
    # Names a host withdrew, to take out of the list at the next put.
    withdrawn: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    keeper: asyncio.Task[None] | None = None

    def wanted(self) -> dict[str, ToolSpec]:
        wanted: dict[str, ToolSpec] = {}
        for tools in self.hosts.values():
            for tool in tools:
                wanted.pop(tool.name, None)
                wanted[tool.name] = tool
        return wanted

    def holds(self, tool_set: ToolSet) -> bool:
        """Whether the list has every wanted tool as declared and no withdrawn one."""
        return all(tool_set.find(name) == tool for name, tool in self.wanted().items()) and not any(
            tool_set.find(name) for name in self.withdrawn
        )


def merge(
    current: Sequence[ToolSpec], wanted: dict[str, ToolSpec], withdrawn: set[str]
) -> tuple[ToolSpec, ...]:
    """The list with the wanted tools in (in place where the name was) and withdrawn ones out."""
    merged = [
        wanted.get(tool.name, tool) for tool in current if tool.name not in withdrawn or tool.name in wanted
    ]
    present = {tool.name for tool in merged}
    merged += [tool for name, tool in wanted.items() if name not in present]
    return tuple(merged)


class Declarations:
    def __init__(self, router: Router, lists: ToolLists | None, limits: Limits = DEFAULT_LIMITS) -> None:
        self._router = router
        self._limits = limits
        self._lists = lists
        self._sessions: dict[str, _Session] = {}
        # What the tools each host session declares take, counted against its grant's share (the
        # registry counts these puts, which come on its internal listener, against no grant).
        self._bytes = Shares(limits, "registry_bytes", "registry_bytes_per_grant", what="bytes of tool lists")
        self._declared: dict[str, int] = {}
        router.closed_hooks.append(self._forget)

    async def declare(
        self, host_session_id: str, tools: Sequence[ToolSpec], sessions: Container[str] | None = None
    ) -> int:
        """Replace what the host declares and put it in its session's list; the session's revision.

        Raises ToolmeshError: HOST_SESSION_UNKNOWN (also for a host session of a
        session other than `sessions`, None: all), INVALID_SCHEMA or
        INVALID_REQUEST (nothing declared), REGISTRY_UNAVAILABLE (declared; the
        keeper puts it once the registry answers).
        """
        host = self._router.host(host_session_id, sessions)
        await asyncio.to_thread(check_tools, tools, self._limits)  # as the registry does
        if self._lists is None:
            raise ToolmeshError(Code.REGISTRY_UNAVAILABLE, "This bridge has no registry address.")
        self._count(host, tools_bytes(tools))
        session = self._sessions.setdefault(host.session_id, _Session())
        previous = session.hosts.pop(host_session_id, ())
        session.hosts[host_session_id] = tuple(tools)
        host.declared_names = frozenset(tool.name for tool in tools)
        session.withdrawn |= {tool.name for tool in previous} - session.wanted().keys()
        if session.keeper is None:
            session.keeper = asyncio.create_task(self._keep(host.session_id, session, self._lists))
        log.info(
            "host declared tools",
            extra={"session_id": host.session_id, "host_session_id": host_session_id, "tools": len(tools)},
        )
        return await self._sync(host.session_id, session, self._lists)

    def _count(self, host: HostSession, size: int) -> None:
        """Count `size` bytes declared by `host` instead of what it declared before. Raises
        QUOTA_EXCEEDED / OVERLOADED, counting what it counted before, when they do not fit."""
        prior = self._declared.pop(host.host_session_id, 0)
        self._bytes.give_back(host.grant, prior)
        try:
            self._bytes.take(host.grant, size)
        except ToolmeshError:
            self._bytes.take(host.grant, prior)  # held a moment ago: it fits
            self._declared[host.host_session_id] = prior
            raise
        self._declared[host.host_session_id] = size

    def _forget(self, host: HostSession) -> None:
        self._bytes.give_back(host.grant, self._declared.pop(host.host_session_id, 0))
        session = self._sessions.get(host.session_id)
        if session is None or session.hosts.pop(host.host_session_id, None) is None:
            return
        if not session.hosts:
            # Nobody maintains this session's tools any more; they stay listed.
            del self._sessions[host.session_id]
            if session.keeper is not None:
                session.keeper.cancel()

    async def aclose(self) -> None:
        keepers = [s.keeper for s in self._sessions.values() if s.keeper is not None]
        self._sessions.clear()
        for keeper in keepers:
            keeper.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)

    async def _sync(self, session_id: str, session: _Session, lists: ToolLists) -> int:
        """Put the wanted tools in the list and the withdrawn ones out, unless it is so already."""
        async with session.lock:
            for _ in range(_PUT_ATTEMPTS):
                current = await lists.get(session_id)
                merged = merge(current.tools, session.wanted(), session.withdrawn)
                if merged == current.tools:
                    session.withdrawn.clear()
                    return current.revision
                try:
                    revision = await lists.put(session_id, merged, current.revision)
                except ToolmeshError as error:
                    if error.code is Code.REVISION_CONFLICT:
                        continue
                    raise
                session.withdrawn.clear()
                return revision
        raise ToolmeshError(Code.REGISTRY_UNAVAILABLE, "The session's tool list kept changing.")

    async def _keep(self, session_id: str, session: _Session, lists: ToolLists) -> None:
        """While hosts declare into the session: put their tools back whenever the list loses them."""
        backoff = Backoff()
        while True:
            try:
                async for tool_set in lists.watch(session_id):
                    backoff.reset()
                    if not session.holds(tool_set):
                        await self._sync(session_id, session, lists)
            except ToolmeshError as error:
                log.warning(
                    "keeping declared tools failed; retrying",
                    extra={"session_id": session_id, "code": error.code.value},
                )
            await asyncio.sleep(backoff.next())
