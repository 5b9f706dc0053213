"""A ToolCatalog that answers from memory, each session's tools kept current by a watch.

Without it every InvokeTool costs a unary GetTool to the registry. With it, the
first lookup for a session opens a WatchTools stream (the registry sends the
current list first, then the list again each time the revision moves) and
waits for its first message; later lookups read the session's ToolSet from
memory.

Consistency, lookup by lookup:

- First lookup for a session: answered from the watch's first message, which
  the registry reads after the watch arrived, so it holds every put that was
  acknowledged before the lookup began. No first message within
  `open_timeout_s` (or the stream fails first) → REGISTRY_UNAVAILABLE, and the
  stream is cancelled.
- The tool is in memory → that definition. It can be stale by the watch's
  delivery delay: a put acknowledged a moment ago that *changed* or *removed*
  the tool may not have reached this process yet, and until its message is
  applied lookups see the previous definition (validated against the previous
  schema, run with the previous timeout and flags). The window is the time
  from the registry storing the put to this process reading the watch message:
  well under a millisecond to a few milliseconds on one host, more with a
  busy registry or a slow network. A slow reader skips intermediate revisions
  but always ends at the latest.
- The tool is not in memory → one direct GetTool before answering None, so a
  tool *added* by a put acknowledged before the lookup is never reported as
  TOOL_NOT_FOUND. (Unknown names therefore still cost one registry call.)
- When the stream fails or ends after its first message (the registry replica
  stopped or restarted, the connection dropped) the session's last list (with
  its revision) is kept and served while the watch reconnects, by itself, with
  a backoff from 50 ms to 1 s (through another registry replica when the
  source has several: toolmesh.invocation.remote's RegistryReplicas). The new
  stream's first message replaces the list. A watch that has not reconnected
  within `stale_s` (60 s) is forgotten: the next lookup opens a watch anew and,
  with every registry down, fails with REGISTRY_UNAVAILABLE. Meanwhile the
  list can miss a put another registry replica acknowledged (with every
  registry down there is none: the registry is the only writer); a name the
  list lacks still costs one direct GetTool. A graceful registry stop or a
  closed connection is noticed at once; a silent network failure only by the
  channel's keepalive (about 30 s), and until then lookups answer from memory,
  which is the staleness window above stretched to that length.

Bounds: at most `max_sessions` sessions are watched (least recently used
dropped first) and a session not looked up for `idle_s` is dropped; dropping
cancels its stream. `aclose()` cancels every stream and task.

The cache is plain asyncio and knows nothing of gRPC: it takes a `WatchSource`
(a session id → an async generator of ToolSets) and a fallback ToolCatalog for
the direct lookups. toolmesh.invocation.remote builds both over a registry
channel (`cached_registry_catalog`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.exceptions import exception_fields
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.invocation.ports import REGISTRY_TIMEOUT_S, ToolCatalog

log = logging.getLogger("toolmesh.invocation.catalog")

# A session's tools: the current list first, then the list each time it changes.
# It may raise ToolmeshError(REGISTRY_UNAVAILABLE) to say why it stopped.
WatchSource = Callable[[str], AsyncGenerator[ToolSet, None]]

DEFAULT_MAX_SESSIONS = 1024
DEFAULT_IDLE_S = 300.0
# How long a session's last list is served while its broken watch reconnects.
DEFAULT_STALE_S = 60.0
# The pauses between reconnections of a broken watch: doubling from the first to the cap.
RECONNECT_FIRST_S = 0.05
RECONNECT_CAP_S = 1.0


def unavailable(session_id: str, **metadata: str) -> ToolmeshError:
    """REGISTRY_UNAVAILABLE for `session_id`'s tools."""
    return ToolmeshError(Code.REGISTRY_UNAVAILABLE, "", {"sessionId": session_id, **metadata})


@dataclass(eq=False, slots=True)
class _Watch:
    session_id: str
    last_used: float
    # The latest list the stream sent; None until its first message.
    tools: ToolSet | None = None
    # Why the stream stopped before its first message (None: dropped by us).
    error: ToolmeshError | None = None
    # Set once the first message arrived or the stream stopped.
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # Dropped by us (LRU, idle): how its stream ended then is no failure of the registry.
    dropped: bool = False
    # When its stream broke after a list arrived (monotonic); None while a stream delivers.
    lost_at: float | None = None


class WatchedCatalog:
    """ToolCatalog over `source` watches, with `fallback` for names the cached list lacks."""

    def __init__(
        self,
        source: WatchSource,
        fallback: ToolCatalog,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        idle_s: float = DEFAULT_IDLE_S,
        open_timeout_s: float = REGISTRY_TIMEOUT_S,
        stale_s: float = DEFAULT_STALE_S,
    ) -> None:
        if max_sessions < 1 or idle_s <= 0 or open_timeout_s <= 0 or stale_s < 0:
            raise ValueError("max_sessions, idle_s and open_timeout_s must be positive")
        self._stale_s = stale_s
        self._source = source
        self._fallback = fallback
        self._max_sessions = max_sessions
        self._idle_s = idle_s
        self._open_timeout_s = open_timeout_s
        # Least recently used first.
        self._watches: OrderedDict[str, _Watch] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def watched_sessions(self) -> list[str]:
        """The sessions watched now, least recently used first."""
        return list(self._watches)

    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        watch = self._use(session_id)
        if watch.tools is None:
            await watch.settled.wait()
        if watch.tools is None:
            if watch.error is not None and not watch.dropped:
                raise watch.error
            # Dropped (LRU) before its first message: ask the registry directly.
            return await self._fallback.get_tool(session_id, name)
        tool = watch.tools.find(name)
        if tool is not None:
            return tool
        # Maybe put a moment ago, with the watch message still on its way.
        return await self._fallback.get_tool(session_id, name)

    async def aclose(self) -> None:
        """Cancel every watch and the idle sweeper, and wait for them to end. Lookups then fail."""
        self._closed = True
        for watch in self._watches.values():
            watch.error = unavailable(watch.session_id, cause="closed")
        self._watches.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _use(self, session_id: str) -> _Watch:
        if self._closed:
            raise unavailable(session_id, cause="closed")
        now = time.monotonic()
        watch = self._watches.get(session_id)
        if watch is not None:
            watch.last_used = now
            self._watches.move_to_end(session_id)
            return watch
        watch = _Watch(session_id, now)
        self._watches[session_id] = watch
        # A context of its own: the stream outlives the call that opened it, and
        # must not join that call's trace or carry its correlation ids.
        watch.task = self._spawn(self._follow(watch), f"toolmesh-watch:{session_id}")
        while len(self._watches) > self._max_sessions:
            _, oldest = self._watches.popitem(last=False)
            self._drop(oldest, "lru")
        if self._sweeper is None:
            self._sweeper = self._spawn(self._sweep_idle(), "toolmesh-watch-sweeper")
        return watch

    def _spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coroutine, name=name, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _drop(self, watch: _Watch, why: str) -> None:
        """Forget `watch` (already out of the map) and cancel its stream."""
        log.debug("tool watch dropped", extra={"session_id": watch.session_id, "why": why})
        watch.dropped = True
        if watch.task is not None:
            watch.task.cancel()

    async def _follow(self, watch: _Watch) -> None:
        """Follow the session's watch; once a list arrived, reconnect a broken stream, serving that
        list meanwhile, for up to `stale_s`."""
        session_id = watch.session_id
        pause = RECONNECT_FIRST_S
        try:
            while True:
                if await self._stream(watch):
                    pause = RECONNECT_FIRST_S
                if watch.tools is None or self._closed:
                    return  # no list yet: the lookup waiting for one gets the error
                now = time.monotonic()
                if watch.lost_at is None:
                    watch.lost_at = now
                if now - watch.lost_at >= self._stale_s:
                    log.warning("tool watch lost: its list is forgotten", extra={"session_id": session_id})
                    return
                log.info(
                    "tool watch reconnecting, its list kept",
                    extra={"session_id": session_id, "revision": watch.tools.revision},
                )
                await asyncio.sleep(pause)
                pause = min(pause * 2, RECONNECT_CAP_S)
        finally:
            watch.settled.set()
            if self._watches.get(session_id) is watch:
                del self._watches[session_id]

    async def _stream(self, watch: _Watch) -> bool:
        """One stream of the session's watch, until it ends or fails (why: `watch.error`); whether
        it delivered a list."""
        session_id = watch.session_id
        received = False
        try:
            async with contextlib.aclosing(self._source(session_id)) as updates:
                try:
                    async with asyncio.timeout(self._open_timeout_s):
                        tools = await anext(updates)
                except TimeoutError:
                    watch.error = unavailable(session_id, cause="watch_timeout")
                    return False
                except StopAsyncIteration:
                    watch.error = unavailable(session_id, cause="watch_ended")
                    return False
                received = True
                watch.tools, watch.lost_at = tools, None
                watch.settled.set()
                async for tools in updates:
                    watch.tools = tools
            log.info("tool watch ended", extra={"session_id": session_id})
            watch.error = unavailable(session_id, cause="watch_ended")
        except ToolmeshError as error:
            watch.error = error
            log.info(
                "tool watch failed", extra={"session_id": session_id, "code": error.code, **error.metadata}
            )
        except Exception as error:
            watch.error = unavailable(session_id, cause=type(error).__name__)
            log.warning(
                "tool watch failed",
                extra={"session_id": session_id, "code": Code.REGISTRY_UNAVAILABLE.value}
                | exception_fields(error),
            )
        return received

    async def _sweep_idle(self) -> None:
        while True:
            now = time.monotonic()
            wait = self._idle_s
            while self._watches:
                oldest = next(iter(self._watches.values()))
                idle_until = oldest.last_used + self._idle_s
                if idle_until > now:
                    wait = idle_until - now
                    break
                del self._watches[oldest.session_id]
                self._drop(oldest, "idle")
            await asyncio.sleep(wait)
