"""The invoker's ports over gRPC: the registry (lookups, and watches for the cache) and the bridge."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from functools import partial

import grpc

from toolmesh.client.registry import RegistryClient
from toolmesh.contracts.routes import route_of
from toolmesh.core import telemetry
from toolmesh.core.calls import ToolRequest
from toolmesh.core.channels import open_channel
from toolmesh.core.deadlines import PAUSE_GRACE_S, Deadlines
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.stream_link import StreamBroken, StreamLink
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.core.wire import outcome_from_pb, progress_from_pb, request_to_pb, tool_from_pb
from toolmesh.invocation.catalog_cache import (
    DEFAULT_IDLE_S,
    DEFAULT_MAX_SESSIONS,
    WatchedCatalog,
    WatchSource,
    unavailable,
)
from toolmesh.invocation.ports import REGISTRY_TIMEOUT_S, BridgeLost, OutcomeElsewhere, ProgressSink
from toolmesh.invocation.redispatch import FIRST_GENERATION, DispatchFence, redispatch_unstarted
from toolmesh.runtime.peers import Connect
from toolmesh.store.base import Store
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, registry_pb2, registry_pb2_grpc

log = logging.getLogger("toolmesh.invocation")

# The bridge enforces the tool's deadline itself; this margin only catches a
# bridge that stopped answering.
BRIDGE_GRACE_S = 2.0
# A new dispatch stream waits this long at most for its bridge's connection; then the request
# fails as not sent (a bridge that refuses connections fails it at once).
CONNECT_S = 5.0
# On a new dispatch stream to a bridge that fenced starts on the last one, the first request waits
# this long at most for the bridge's word (starts_fenced, its first message).
FENCE_WORD_S = 1.0
# While a read-only or idempotent request whose bridge replica died waits for another replica to
# be named by its session's route, the route is read again this often.
ROUTE_POLL_S = 0.25
DISPATCH_METHOD = "toolmesh.v1.BridgeService/DispatchToolRequests"
# A link to a bridge replica other than the default closes after this long without requests.
LINK_IDLE_S = 30.0
# A session's route is read again after this long; sooner when the replica it named has no host.
ROUTE_CACHE_S = 1.0
ROUTE_CACHE_SIZE = 10_000


class RemoteCatalog:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = registry_pb2_grpc.RegistryServiceStub(channel)

    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        try:
            with telemetry.client_call("toolmesh.v1.RegistryService/GetTool") as metadata:
                response = await self._stub.GetTool(
                    registry_pb2.GetToolRequest(session_id=session_id, name=name),
                    timeout=REGISTRY_TIMEOUT_S,
                    metadata=metadata,
                )
        except grpc.aio.AioRpcError as error:
            if error_code(error) is Code.TOOL_NOT_FOUND:
                return None
            raise ToolmeshError(Code.REGISTRY_UNAVAILABLE, "", {"grpcStatus": error.code().name}) from None
        return tool_from_pb(response.tool)


def registry_watch_source(client: RegistryClient) -> WatchSource:
    """WatchTools through `client`, its gRPC failures as REGISTRY_UNAVAILABLE."""

    async def watch(session_id: str) -> AsyncGenerator[ToolSet, None]:
        try:
            async with contextlib.aclosing(client.watch_tools(session_id)) as updates:
                async for tools in updates:
                    yield tools
        except grpc.aio.AioRpcError as error:
            raise unavailable(session_id, grpcStatus=error.code().name) from None

    return watch


def cached_registry_catalog(
    registry_target: str,
    channel: grpc.aio.Channel,
    *,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    idle_s: float = DEFAULT_IDLE_S,
) -> WatchedCatalog:
    """The invocation service's catalog: watches over `channel`, direct GetTool as the fallback."""
    return replicated_registry_catalog([(registry_target, channel)], max_sessions=max_sessions, idle_s=idle_s)


def replicated_registry_catalog(
    replicas: Sequence[tuple[str, grpc.aio.Channel]],
    *,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    idle_s: float = DEFAULT_IDLE_S,
) -> WatchedCatalog:
    """The catalog over several registry replicas (target, channel): watches and direct GetTool
    through one of them, through the next when it fails (RegistryReplicas)."""
    registries = RegistryReplicas(replicas)
    return WatchedCatalog(registries.watch, registries, max_sessions=max_sessions, idle_s=idle_s)


# A target in gRPC's own syntax, which may name several addresses: one channel, balanced.
GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:")


def registry_targets(text: str) -> list[str]:
    """The registry replicas `--registry` names: a comma-separated list of host:port (a channel
    each), or one gRPC target (`dns:///name:port`, `ipv4:a:p,b:p`: one channel, round_robin).

    Raises ValueError when it names none.
    """
    text = text.strip()
    targets = [text] if text.startswith(GRPC_SCHEMES) else [t.strip() for t in text.split(",") if t.strip()]
    if not targets:
        raise ValueError("--registry names no address")
    return targets


def balanced(target: str) -> bool:
    """Whether `target` is one gRPC target that may resolve to several addresses (round_robin)."""
    return target.startswith(GRPC_SCHEMES)


class RegistryReplicas:
    """Registry replicas sharing one store: each lookup and each watch goes to the replica that
    last answered, and on to the next when it is unavailable (a gRPC failure): so one replica
    down fails no lookup while another answers. A balanced target (one channel over several
    addresses) is tried twice, for gRPC to pick another address."""

    def __init__(self, replicas: Sequence[tuple[str, grpc.aio.Channel]]) -> None:
        if not replicas:
            raise ValueError("no registry replica")
        self._clients = [RegistryClient(target, channel=channel) for target, channel in replicas]
        self._catalogs = [RemoteCatalog(channel) for _, channel in replicas]
        self._preferred = 0

    def _order(self) -> list[int]:
        count = len(self._catalogs)
        return [(self._preferred + i) % count for i in range(max(count, 2))]

    def _failed(self, index: int) -> None:
        if self._preferred == index:
            self._preferred = (index + 1) % len(self._catalogs)

    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        last: ToolmeshError | None = None
        for index in self._order():
            try:
                return await self._catalogs[index].get_tool(session_id, name)
            except ToolmeshError as error:
                if error.code is not Code.REGISTRY_UNAVAILABLE:
                    raise
                self._failed(index)
                last = error
        assert last is not None
        raise last

    async def watch(self, session_id: str) -> AsyncGenerator[ToolSet, None]:
        """WatchTools through the first replica that answers. A stream that breaks after its first
        message raises REGISTRY_UNAVAILABLE: the cache keeps the list and reconnects.

        A replica that takes the stream and sends nothing (a stopped process keeps its connections
        open) is left for the next one (if there is one) after its share of REGISTRY_TIMEOUT_S, so that the
        cache's own wait for a first list still ends with one from a replica that answers."""
        last: ToolmeshError | None = None
        order = self._order()
        first_list_s = REGISTRY_TIMEOUT_S / (len(order) + 1)
        for position, index in enumerate(order):
            received = False
            # The last replica to try gets the cache's whole wait: there is none to leave it for.
            bound = first_list_s if position < len(order) - 1 else None
            try:
                async with contextlib.aclosing(self._clients[index].watch_tools(session_id)) as updates:
                    try:
                        async with asyncio.timeout(bound):
                            tools = await anext(updates)
                    except TimeoutError:
                        self._failed(index)
                        last = unavailable(session_id, cause="watch_timeout")
                        continue
                    except StopAsyncIteration:
                        return
                    received = True
                    yield tools
                    async for tools in updates:
                        yield tools
                return
            except grpc.aio.AioRpcError as error:
                self._failed(index)
                last = unavailable(session_id, grpcStatus=error.code().name)
                if received:
                    raise last from None
        assert last is not None
        raise last


@dataclass(slots=True)
class _LinkFence:
    """Whether the bridge at the other end of one dispatch stream fences starts (it says so first)."""

    fenced: bool = False

    def heard(self, response: bridge_pb2.DispatchToolRequestsResponse) -> None:
        if response.starts_fenced:
            self.fenced = True


class RemoteDispatcher:
    """Tool requests to the bridge, all on one DispatchToolRequests stream.

    One stream rather than a call per request: a call held for as long as a
    tool runs costs each side about 20 KB, which is most of what a held
    invocation costs. When the stream breaks, the requests on it fail with
    BRIDGE_UNAVAILABLE (BridgeLost) and the next request opens a new one.

    A stream opens only on a connected channel (waiting up to `connect_s`), and
    the ids of the requests handed to it are kept while they wait: a request
    that failed before either is known not to have left (BridgeLost.sent False).
    """

    def __init__(self, channel: grpc.aio.Channel, *, connect_s: float = CONNECT_S) -> None:
        self._channel = channel
        self._connect_s = connect_s
        self._stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        self._link: DispatchLink | None = None
        # The ids of the requests handed to the current link's stream and not answered yet.
        self._sent: set[str] = set()
        # Where the progress reports of requests on the link go, by tool request id.
        self._progress: dict[str, ProgressSink] = {}
        self._connecting: asyncio.Future[None] | None = None
        self._fence = _LinkFence()
        # The bridge at this address said it fences starts, on the last stream that heard its word.
        self._fenced_before = False
        # Each request's guard against a quiet bridge, on one timer (toolmesh.core.deadlines).
        self._guards: Deadlines[_Guard] = Deadlines(self._quiet)

    async def _open_link(self) -> tuple[DispatchLink, set[str], _LinkFence]:
        link = self._link
        if link is None or link.closed:
            # One wait for the connection, shared by every dispatch that needs it meanwhile.
            connecting = self._connecting
            if connecting is None or connecting.done():
                connecting = self._connecting = asyncio.ensure_future(self._connected())
                connecting.add_done_callback(_seen)
            await asyncio.shield(connecting)
            link = self._link  # another dispatch may have opened one meanwhile
            if link is None or link.closed:
                sent: set[str] = set()
                fence = self._fence = _LinkFence()
                link = self._link = StreamLink(
                    self._stub.DispatchToolRequests,
                    batch=partial(_dispatch_message, sent),
                    size_of=_size,
                    results_of=lambda response: response.results,
                    key_of=lambda result: result.tool_request_id,
                    on_response=partial(self._progressed, fence),
                )
                self._sent = sent
        return link, self._sent, self._fence

    async def _connected(self) -> None:
        """Wait for the channel to be connected; BridgeLost (not sent) when it fails or takes too long."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._connect_s
        state = self._channel.get_state(try_to_connect=True)
        while state is not grpc.ChannelConnectivity.READY:
            left = give_up - loop.time()
            if state in _DOWN or left <= 0:
                raise BridgeLost({"grpcStatus": "UNAVAILABLE", "channel": state.name}, sent=False)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._channel.wait_for_state_change(state), left)
            state = self._channel.get_state(try_to_connect=True)

    async def _fence_word(self, link: DispatchLink, fence: _LinkFence) -> None:
        """On a new stream to a bridge that fenced starts before, wait (FENCE_WORD_S at most) for it
        to say so again before sending: a stream that breaks before its word then sent nothing
        (BridgeLost, not sent), where it would leave a request that may have started unfenced, for
        the ledger to decide at its deadline. A bridge that stopped fencing is waited for once."""
        if fence.fenced or not self._fenced_before:
            return
        try:
            spoke = await asyncio.wait_for(asyncio.shield(link.spoke), FENCE_WORD_S)
        except TimeoutError:
            self._fenced_before = False
            return
        if not spoke:
            raise BridgeLost({"grpcStatus": "UNAVAILABLE", "stream": "ended before a word"}, sent=False)
        self._fenced_before = fence.fenced

    def _progressed(self, fence: _LinkFence, response: bridge_pb2.DispatchToolRequestsResponse) -> None:
        fence.heard(response)
        if response.starts_fenced:
            self._fenced_before = True
        for report in response.progress:
            sink = self._progress.get(report.tool_request_id)
            if sink is not None:
                sink(progress_from_pb(report))

    async def dispatch(
        self,
        request: ToolRequest,
        on_progress: ProgressSink | None = None,
        *,
        generation: int = 0,
        claimed: asyncio.Future[None] | None = None,
    ) -> Outcome:
        """The request's outcome; `generation`: its dispatch generation (the start fence; 0: none).

        `claimed`: the request's claim is on its way (toolmesh.invocation.early): it goes at once to
        a bridge that said it fences starts (no host starts it before the claim is in the ledger),
        to any other once `claimed` is done; raises as `claimed` does when that fails first.
        """
        link, sent, fence = await self._open_link()
        await self._fence_word(link, fence)
        if claimed is not None and not fence.fenced:
            await asyncio.shield(claimed)
        tool_request_id = request.tool_request_id
        with telemetry.client_span(DISPATCH_METHOD) as carrier:
            message = request_to_pb(request)
            message.trace_context.update(carrier)
            if generation:
                message.dispatch_generation = generation
            result = link.expect(tool_request_id)
            link.send(message)
            # The bridge enforces the deadline; this only catches a bridge that went quiet.
            wait_s = request.timeout_ms / 1000 + BRIDGE_GRACE_S
            guard = _Guard(result)
            self._guards.add(guard, wait_s)
            if on_progress is not None:
                self._progress[tool_request_id] = on_progress
            try:
                return _outcome_of(await result)
            except StreamBroken as broken:
                raise _unavailable(broken, sent=tool_request_id in sent, fenced=fence.fenced) from None
            except TimeoutError:
                detail = f"No result within {request.timeout_ms} ms."
                return Outcome.runtime_error(Code.TOOL_TIMEOUT, detail, {"timeoutMs": request.timeout_ms})
            finally:
                self._guards.discard(guard)
                sent.discard(tool_request_id)
                self._progress.pop(tool_request_id, None)
                # Not answered (gave up, or this wait was cancelled): tell the bridge to stop it.
                if link.forget(tool_request_id) and not link.closed:
                    link.send(tool_request_id)

    def _quiet(self, guard: _Guard) -> None:
        """End the wait with TimeoutError PAUSE_GRACE_S after the guard first fires.

        Its firing may be the first thing this process does after a pause (SIGSTOP, a starved
        loop) during which the bridge answered: the answer, queued in the socket, is read first.
        How late a guard fires tells no such pause apart: a pause that ended just after the guard
        was due made it fire barely late, ahead of the answer (`bench.chaos --seed 47` lost three
        results so, with their invocation replica thawed 0.3 s after their guards were due).
        """
        if guard.result.done():
            return
        if not guard.deferred:
            guard.deferred = True
            self._guards.add(guard, PAUSE_GRACE_S)
            return
        guard.result.set_exception(TimeoutError())

    async def aclose(self) -> None:
        self._guards.close()
        if self._link is not None:
            await self._link.aclose()


_DOWN = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


def _seen(connecting: asyncio.Future[None]) -> None:
    """Its failure reaches the dispatches that wait for it; marked as seen in case none is left."""
    if not connecting.cancelled():
        connecting.exception()


DispatchLink = StreamLink[
    bridge_pb2.ToolRequest | str,
    bridge_pb2.DispatchToolRequestsRequest,
    bridge_pb2.DispatchToolRequestsResponse,
    bridge_pb2.DispatchResult,
]


def _dispatch_message(
    sent: set[str], batch: list[bridge_pb2.ToolRequest | str]
) -> bridge_pb2.DispatchToolRequestsRequest:
    """Requests, and the ids (str) of requests to cancel, in one message; the requests' ids go in
    `sent` (built as the stream takes the message: from then on, it may have left)."""
    message = bridge_pb2.DispatchToolRequestsRequest()
    for item in batch:
        if isinstance(item, str):
            message.cancel_tool_request_ids.append(item)
        else:
            message.requests.append(item)
            sent.add(item.tool_request_id)
    return message


def _unavailable(broken: StreamBroken, *, sent: bool, fenced: bool) -> BridgeLost:
    metadata = {"grpcStatus": broken.status}
    refused = error_code(broken.error) if broken.error is not None else None
    if refused is not None:
        # The bridge answered but would not take the stream: a configuration to fix, not an outage.
        metadata["reason"] = refused.value
        log.error("the bridge refused the dispatch stream", extra={"reason": refused.value})
    return BridgeLost(metadata, sent=sent, fenced=fenced)


@dataclass(eq=False, slots=True)
class _Guard:
    """A dispatched request's wait for its outcome, and when a quiet bridge ends it."""

    result: asyncio.Future[bridge_pb2.DispatchResult]
    deferred: bool = False


def _outcome_of(result: bridge_pb2.DispatchResult) -> Outcome:
    if result.HasField("outcome"):
        return outcome_from_pb(result.outcome)
    # Malformed or duplicate: this service sent what it should not have.
    refusal = result.refusal
    log.error("the bridge refused a tool request", extra={"reason": refusal.reason})
    raise ToolmeshError(Code.INTERNAL, "The bridge refused the request.", {"reason": refusal.reason})


def _size(item: bridge_pb2.ToolRequest | str) -> int:
    return len(item) if isinstance(item, str) else item.ByteSize()


class _Bridge:
    """One bridge replica's channel and dispatch stream, and how many requests ride it now."""

    def __init__(self, target: str, connect: Connect) -> None:
        self.channel = connect(target)
        self.dispatcher = RemoteDispatcher(self.channel)
        self.busy = 0
        self.idle: asyncio.TimerHandle | None = None

    async def aclose(self) -> None:
        await self.dispatcher.aclose()
        await self.channel.close()


class RoutedDispatcher:
    """Tool requests to the bridge replica that holds a host of their session.

    Each bridge replica writes its address under the sessions it holds hosts of
    (toolmesh.contracts.routes); a request goes to the replica its session's route
    names, over one DispatchToolRequests stream per replica, opened on demand and
    closed after `idle_s` without requests. Without a route it goes to
    `default_target`, which answers TOOL_HOST_UNAVAILABLE when it holds no host either.

    With `recorded` (bridges record outcomes in a ledger shared with this process), a link
    that breaks under a request that may have reached its bridge raises OutcomeElsewhere rather
    than BRIDGE_UNAVAILABLE, or sends a redeliverable one to another replica. A request that
    never left ends at once with TOOL_HOST_UNAVAILABLE (nothing ran), unless another replica
    holds a host of the session.

    With `fence` (the shared ledger's start fence, toolmesh.invocation.redispatch), requests that
    are not redeliverable carry their dispatch generation; one whose replica was lost before it
    let a host start it is sent through another (`redispatch_unstarted`).
    """

    def __init__(
        self,
        store: Store,
        default_target: str,
        connect: Connect = open_channel,
        *,
        idle_s: float = LINK_IDLE_S,
        recorded: bool = False,
        route_cache_s: float = ROUTE_CACHE_S,
        fence: DispatchFence | None = None,
    ) -> None:
        self._store = store
        self._fence = fence
        self._route_cache_s = route_cache_s
        self._recorded = recorded
        self._default = default_target
        self._connect = connect
        self._idle_s = idle_s
        self._bridges: dict[str, _Bridge] = {}
        # Each session's route as last read, and when (time.monotonic()).
        self._routes: dict[str, tuple[str, float]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def targets(self) -> list[str]:
        """The bridge replicas with an open link."""
        return list(self._bridges)

    async def dispatch(
        self,
        request: ToolRequest,
        on_progress: ProgressSink | None = None,
        *,
        claimed: asyncio.Future[None] | None = None,
    ) -> Outcome:
        """The outcome from the session's bridge replica; ToolmeshError(BRIDGE_UNAVAILABLE or
        STORE_UNAVAILABLE, when the route cannot be read) when it has none.

        `claimed`: sent while its claim is on its way (StreamDispatcher.dispatch); a fenced request.

        A route read within `route_cache_s` is used again without reading the store. When the
        replica it names holds no host of the session (TOOL_HOST_UNAVAILABLE) or cannot be
        reached (the request never left), nothing ran: the route is read again and the request
        goes to the replica it names, or to the default, if not tried yet; else the call ends
        with TOOL_HOST_UNAVAILABLE at once.

        With `recorded`, a link that breaks after the request was handed to it raises
        OutcomeElsewhere (the host may run it and hand its outcome to another replica), except
        for a read-only or idempotent request: that one is sent again, with the time it has
        left, to another replica once the session's route names one (see `_redeliver`).
        """
        session_id = request.session_id
        cached = self._routes.get(session_id)
        if cached is not None and time.monotonic() - cached[1] < self._route_cache_s:
            target = cached[0]
        else:
            target = await self._read_route(session_id)
        tried: set[str] = set()
        generation = FIRST_GENERATION if self._fence is not None and not request.redeliverable else 0
        if claimed is not None and not generation:
            # Unfenced, a host could start it before its claim is in the ledger: it waits for it.
            await asyncio.shield(claimed)
            claimed = None
        while True:
            tried.add(target)
            try:
                outcome = await self._send(target, request, on_progress, generation, claimed)
            except BridgeLost as lost:
                # A refusal (a reason) is a configuration to fix, not a replica gone.
                if "reason" in lost.metadata:
                    raise
                if lost.sent:
                    if not self._recorded:
                        raise
                    if request.redeliverable:
                        return await self._redeliver(request, tried, on_progress)
                    if self._fence is None or not lost.fenced:
                        raise OutcomeElsewhere from None
                    return await redispatch_unstarted(
                        request,
                        generation,
                        self._fence,
                        partial(self._send_again, on_progress),
                        self._read_route,
                    )
                outcome = _unreachable(session_id)
            if not _no_host(outcome):
                return outcome
            other = await self._untried(session_id, tried)
            if other is None:
                return outcome
            target = other

    async def _untried(self, session_id: str, tried: set[str]) -> str | None:
        """The replica the session's route names, else the default, unless already tried."""
        for target in (await self._read_route(session_id), self._default):
            if target not in tried:
                return target
        return None

    async def _redeliver(
        self, request: ToolRequest, tried: set[str], on_progress: ProgressSink | None
    ) -> Outcome:
        """Send a read-only or idempotent request whose replica died to another one.

        The route names the dead replica until another replica writes it (at once when a host
        of the session connects there, else within its refresh) or it expires; it is read again
        every ROUTE_POLL_S until the request's time is up, then the ledger decides
        (OutcomeElsewhere). It may have started on the first host: safe, it is redeliverable.
        """
        give_up = time.monotonic() + request.timeout_ms / 1000
        while (left_s := give_up - time.monotonic()) > 0:
            target = await self._untried(request.session_id, tried)
            if target is None:
                await asyncio.sleep(min(ROUTE_POLL_S, left_s))
                continue
            tried.add(target)
            log.warning("bridge replica lost: sending a redeliverable request to another one")
            again = replace(request, timeout_ms=max(1, int(left_s * 1000)))
            try:
                outcome = await self._send(target, again, on_progress)
            except BridgeLost as lost:
                if lost.sent or "reason" in lost.metadata:
                    raise OutcomeElsewhere from None
                continue
            if not _no_host(outcome):
                return outcome
            # That replica holds no host of it (yet): try it again when the route names it.
            tried.discard(target)
            await asyncio.sleep(min(ROUTE_POLL_S, max(give_up - time.monotonic(), 0)))
        raise OutcomeElsewhere

    async def _read_route(self, session_id: str) -> str:
        target = await route_of(self._store, session_id) or self._default
        if len(self._routes) >= ROUTE_CACHE_SIZE:
            self._routes.clear()
        self._routes[session_id] = (target, time.monotonic())
        return target

    async def _send_again(
        self, on_progress: ProgressSink | None, target: str, request: ToolRequest, generation: int
    ) -> Outcome:
        return await self._send(target, request, on_progress, generation)

    async def _send(
        self,
        target: str,
        request: ToolRequest,
        on_progress: ProgressSink | None,
        generation: int = 0,
        claimed: asyncio.Future[None] | None = None,
    ) -> Outcome:
        bridge = self._bridges.get(target)
        if bridge is None:
            bridge = self._bridges[target] = _Bridge(target, self._connect)
        if bridge.idle is not None:
            bridge.idle.cancel()
            bridge.idle = None
        bridge.busy += 1
        try:
            return await bridge.dispatcher.dispatch(
                request, on_progress, generation=generation, claimed=claimed
            )
        finally:
            bridge.busy -= 1
            if bridge.busy == 0 and target != self._default:
                bridge.idle = asyncio.get_running_loop().call_later(self._idle_s, self._close_idle, target)

    def _close_idle(self, target: str) -> None:
        bridge = self._bridges.get(target)
        if bridge is None or bridge.busy:
            return
        del self._bridges[target]
        task = asyncio.create_task(bridge.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        bridges, self._bridges = list(self._bridges.values()), {}
        for bridge in bridges:
            if bridge.idle is not None:
                bridge.idle.cancel()
            await bridge.aclose()
        if self._closing:
            await asyncio.wait(set(self._closing))


def _unreachable(session_id: str) -> Outcome:
    """The session's bridge replica could not be reached and the request never left: nothing ran."""
    return Outcome.runtime_error(
        Code.TOOL_HOST_UNAVAILABLE,
        "Its bridge could not be reached; the request was not sent.",
        {"sessionId": session_id, "bridge": "unreachable"},
    )


def _no_host(outcome: Outcome) -> bool:
    return outcome.failure is not None and outcome.failure.code == Code.TOOL_HOST_UNAVAILABLE
