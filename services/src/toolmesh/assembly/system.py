"""Assembling the three services, alone or together on the embedded default."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from toolmesh.bridge.cancels import HeldRequests
from toolmesh.bridge.declarations import Declarations
from toolmesh.bridge.observability import RouterTelemetry
from toolmesh.bridge.outcomes import OutcomeRecorder
from toolmesh.bridge.registry_lists import RegistryToolLists
from toolmesh.bridge.router import Router
from toolmesh.bridge.routes import Routes
from toolmesh.bridge.servicer import bridge_service
from toolmesh.bridge.web import HOST_FACING_PATHS, start_web_server, web_connect
from toolmesh.contracts.cancels import RECORDED_KEY, CancelBoard
from toolmesh.contracts.ledger import Ledger, LedgerPolicy
from toolmesh.invocation import web as invocation_web
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.observability import InvocationTelemetry
from toolmesh.invocation.progress_relay import ProgressRelay
from toolmesh.invocation.quotas import Quotas
from toolmesh.invocation.remote import (
    RoutedDispatcher,
    balanced,
    registry_targets,
    replicated_registry_catalog,
)
from toolmesh.invocation.servicer import invocation_service
from toolmesh.invocation.validation import Validation
from toolmesh.registry import web as registry_web
from toolmesh.registry.registry import Registry
from toolmesh.registry.servicer import registry_service
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.runtime.security import LOOPBACK, Security
from toolmesh.runtime.server import CannotListen, RunningServer, start_server
from toolmesh.runtime.web import WebRoutes, WebServer, guarded
from toolmesh.store.backends import MEMORY, Stores, open_stores

# How long a starting replica waits to follow the cancellations posted in the store.
FOLLOW_READY_S = 5.0
# Internal listeners on a free loopback port unless told otherwise.
INTERNAL_ADDRESS = "127.0.0.1:0"


async def start_registry(
    address: str = "127.0.0.1:0",
    stores: Stores | None = None,
    *,
    security: Security = LOOPBACK,
    internal_address: str = INTERNAL_ADDRESS,
    limits: Limits = DEFAULT_LIMITS,
    web_routes: WebRoutes | None = None,
    web_address: str | None = None,
    web_origins: Sequence[str] = (),
    web_hosts: Sequence[str] = (),
) -> RunningServer:
    """The registry, keeping its tools in `stores` (closed when it stops; default: its own memory).

    With `web_routes` (a web port of this process), its read RPCs are served there too; with
    `web_address`, on a web port of its own (`web_origins`, `web_hosts` as for the bridge's).
    """
    if web_address is not None:
        security.check_public(web_address)
    stores = stores or open_stores()
    registry = Registry(stores.store, limits)
    # A port of its own, unless it shares one of this process's (web_routes).
    own_routes = WebRoutes() if web_address is not None and web_routes is None else None
    routes = web_routes or own_routes
    if routes is not None:
        app = registry_web.web_connect(registry, security.verifier, read_max_bytes=limits.message_bytes)
        routes.add(app, registry_web.READ_PATHS)
    try:
        running = await start_server(
            [registry_service(registry)],
            address,
            security=security,
            internal_address=internal_address,
            limits=limits,
        )
    except CannotListen:
        await stores.close()
        raise
    running.after_stop.append(stores.close)
    if own_routes is not None and web_address is not None:
        await serve_web_port(
            running, own_routes, web_address, web_origins=web_origins, web_hosts=web_hosts, security=security
        )
    return running


async def serve_web_port(
    running: RunningServer,
    routes: WebRoutes,
    web_address: str,
    *,
    web_origins: Sequence[str],
    web_hosts: Sequence[str],
    security: Security,
) -> WebServer:
    """Serve `routes` on a web port of `running`'s, stopped first after its gRPC server (whose
    streams have ended by then); stops `running` and raises CannotListen when the address is taken."""
    hosts = [*web_hosts, web_address.rpartition(":")[0].strip("[]")]
    app = guarded(routes, routes, web_origins, hosts, serving=lambda: not running.draining)
    try:
        web = await start_web_server(app, web_address, security.tls)
    except CannotListen:
        await running.stop(0)
        raise
    running.web_port = web.port
    running.after_stop.insert(0, lambda: web.stop(1.0))
    return web


async def start_bridge(
    address: str = "127.0.0.1:0",
    heartbeat_s: float = 5.0,
    *,
    registry_target: str | None = None,
    web_address: str | None = None,
    web_origins: Sequence[str] = (),
    web_hosts: Sequence[str] = (),
    security: Security = LOOPBACK,
    internal_address: str = INTERNAL_ADDRESS,
    stores: Stores | None = None,
    advertise: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    web_routes: WebRoutes | None = None,
) -> tuple[RunningServer, Router]:
    """The bridge on `address`, its internal listener (Dispatch, for the invocation service) on
    `internal_address`, and on `web_address` for pages (Connect, gRPC-Web) when given.

    With `stores` (closed when it stops), it writes there the routes of the sessions it holds
    hosts of, under `advertise` (default: its internal listener's address), for invocation
    replicas to find it (toolmesh.contracts.routes).

    With `registry_target` (the registry's internal listener), hosts may declare their tools
    (DeclareHostTools); `web_origins` are the browser origins allowed besides the web port's own;
    `web_hosts` the names its requests' Host may give besides loopback's, its bound address and the
    origins' (DNS rebinding). With `web_routes`, its web port also serves the routes the other
    services of this process add there (one origin for a page).
    """
    if web_address is not None:
        security.check_public(web_address)
    ledger = None if stores is None else Ledger(stores.ledger, ledger_policy(limits))
    # With a ledger shared with the invocation service, starts are fenced there (bridge.router).
    fence = ledger if stores is not None and stores.shared else None
    router = Router(heartbeat_s=heartbeat_s, observer=RouterTelemetry(), limits=limits, fence=fence)
    if registry_target is not None:
        security.check_peer()
    lists = RegistryToolLists(registry_target, security.peer_channel) if registry_target is not None else None
    declarations = Declarations(router, lists, limits)
    recorder = (
        None
        if ledger is None or stores is None
        else OutcomeRecorder(ledger, recorded_elsewhere=CancelBoard(stores.store, RECORDED_KEY))
    )
    holds = HeldRequests()
    service = bridge_service(router, declarations, recorder, None if stores is None else holds)
    running = await start_server(
        [service], address, security=security, internal_address=internal_address, limits=limits
    )
    if stores is not None:
        host = internal_address.rsplit(":", 1)[0]
        routes = Routes(stores.store, advertise or f"{host}:{running.internal_port}", router)
        routes.start()
        # Requests outlive the invocation replica that sent them: a cancellation another one
        # takes comes through the store.
        board = CancelBoard(stores.store)
        stop_following = await follow_cancellations(lambda ready: holds.follow(board, ready))
        running.after_stop += [routes.aclose, stop_following]
    if recorder is not None:
        running.after_stop.append(recorder.aclose)
    if stores is not None:
        running.after_stop.append(stores.close)
    if lists is not None:
        running.after_stop.append(lists.aclose)
    if web_address is not None:
        served = web_routes if web_routes is not None else WebRoutes()
        connect = web_connect(
            router, declarations, security.verifier, recorder, read_max_bytes=limits.message_bytes
        )
        served.add(connect, HOST_FACING_PATHS)
        web = await serve_web_port(
            running, served, web_address, web_origins=web_origins, web_hosts=web_hosts, security=security
        )
        shutdown = service.on_shutdown

        async def on_shutdown() -> None:
            web.stop_accepting()
            if shutdown is not None:
                await shutdown()

        service.on_shutdown = on_shutdown
    return running, router


async def follow_cancellations(
    follow: Callable[[asyncio.Event], Coroutine[Any, Any, None]],
) -> Callable[[], Awaitable[None]]:
    """Start `follow(ready)` in a task, wait up to FOLLOW_READY_S for it to set `ready` (it
    follows the store's cancellations), and return what stops it."""
    ready = asyncio.Event()
    following = asyncio.create_task(follow(ready))
    with contextlib.suppress(TimeoutError):  # a store still unreachable: it follows once it is back
        await asyncio.wait_for(ready.wait(), FOLLOW_READY_S)

    async def stop_following() -> None:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following

    return stop_following


def ledger_policy(limits: Limits) -> LedgerPolicy:
    """The ledger's windows as the operator's limits set them (the rest at their defaults)."""
    return dataclasses.replace(
        LedgerPolicy(),
        replay_window_s=float(limits.replay_window_s),
        timeout_replay_window_s=float(limits.timeout_replay_window_s),
        late_retry_notice_s=float(limits.late_retry_notice_s),
    )


async def start_invocation(
    registry_target: str,
    bridge_target: str,
    address: str = "127.0.0.1:0",
    *,
    stores: Stores | None = None,
    policy: LedgerPolicy | None = None,
    max_in_flight: int | None = None,
    security: Security = LOOPBACK,
    limits: Limits = DEFAULT_LIMITS,
    web_routes: WebRoutes | None = None,
    web_address: str | None = None,
    web_origins: Sequence[str] = (),
    web_hosts: Sequence[str] = (),
) -> RunningServer:
    """The invocation service; `registry_target` and `bridge_target` are their internal listeners.

    `registry_target` may name several registry replicas (on one store): `a:7411,b:7411`, or a gRPC
    target such as `dns:///registry:7411` or `ipv4:10.0.0.1:7411,10.0.0.2:7411` (round_robin).

    It keeps its ledger in `stores` (closed when it stops; default: its own memory). With
    `web_routes` (a web port of this process), its caller RPCs are served there too; with
    `web_address`, on a web port of its own (`web_origins`, `web_hosts` as for the bridge's).
    """
    security.check_public(address)
    if web_address is not None:
        security.check_public(web_address)
    security.check_peer()
    stores = stores or open_stores()
    # Every registry replica `registry_target` names (comma-separated, or one gRPC target).
    registries = [
        (target, security.peer_channel(target, balanced=balanced(target)))
        for target in registry_targets(registry_target)
    ]
    ledger = Ledger(stores.ledger, policy or ledger_policy(limits))
    # Each session's tools from a registry watch, GetTool only for names not in it.
    catalog = replicated_registry_catalog(registries)
    dispatcher = RoutedDispatcher(
        stores.store,
        bridge_target,
        security.peer_channel,
        recorded=stores.shared,
        fence=ledger if stores.shared else None,
    )
    # Replicas sharing the ledger hear of each other's cancellations through the store.
    cancels = CancelBoard(stores.store) if stores.shared else None
    # And of outcomes a bridge replica recorded for requests another replica sent.
    recorded = CancelBoard(stores.store, RECORDED_KEY) if stores.shared else None
    # And of the progress of invocations their callers joined through another replica.
    relay = ProgressRelay(stores.store) if stores.shared else None
    validation = Validation(limits)
    invoker = Invoker(
        catalog,
        dispatcher,
        ledger,
        max_in_flight,
        observer=InvocationTelemetry(),
        validation=validation,
        quotas=Quotas(stores.store, limits),
        cancels=cancels,
        progress=relay,
        recorded_elsewhere=recorded,
        # Bridge replicas sharing the ledger fence starts: requests go as their claims do.
        early=dispatcher if stores.shared else None,
    )
    # A port of its own, unless it shares one of this process's (web_routes).
    own_routes = WebRoutes() if web_address is not None and web_routes is None else None
    routes = web_routes or own_routes
    if routes is not None:
        app = invocation_web.web_connect(invoker, security.verifier, read_max_bytes=limits.message_bytes)
        routes.add(app, invocation_web.CALLER_FACING_PATHS)
    stop_following = await follow_cancellations(invoker.follow_cancellations)
    stop_following_recorded = await follow_cancellations(invoker.follow_recorded_elsewhere)
    closers = [
        validation.aclose,
        stop_following,
        stop_following_recorded,
        *([relay.aclose] if relay is not None else []),
        catalog.aclose,
        *(channel.close for _, channel in registries),
        dispatcher.aclose,
        ledger.aclose,
        stores.close,
    ]
    try:
        running = await start_server([invocation_service(invoker)], address, security=security, limits=limits)
    except CannotListen:
        for close in closers:
            await close()
        raise
    running.after_stop += closers
    if own_routes is not None and web_address is not None:
        await serve_web_port(
            running, own_routes, web_address, web_origins=web_origins, web_hosts=web_hosts, security=security
        )
    return running


@dataclass
class LocalSystem:
    """All three services in one process, each on its own port."""

    registry: RunningServer
    invocation: RunningServer
    bridge: RunningServer
    router: Router
    host: str
    # The web port serves HTTPS (the services have a certificate).
    web_tls: bool = False
    # How the services are secured, their service token included (start_replicas uses it too).
    security: Security = LOOPBACK

    @property
    def registry_target(self) -> str:
        return f"{self.host}:{self.registry.port}"

    @property
    def invocation_target(self) -> str:
        return f"{self.host}:{self.invocation.port}"

    @property
    def bridge_target(self) -> str:
        return f"{self.host}:{self.bridge.port}"

    @property
    def web_url(self) -> str:
        """Where pages reach the bridge (Connect, gRPC-Web)."""
        scheme = "https" if self.web_tls else "http"
        return f"{scheme}://{self.host}:{self.bridge.web_port}"

    @property
    def registry_internal_target(self) -> str:
        return f"127.0.0.1:{self.registry.internal_port}"

    @property
    def bridge_internal_target(self) -> str:
        return f"127.0.0.1:{self.bridge.internal_port}"

    @property
    def servers(self) -> list[RunningServer]:
        return [self.invocation, self.bridge, self.registry]

    async def stop(self, grace: float = 1.0) -> None:
        # Callers first, so nothing new reaches the services behind them.
        for server in self.servers:
            await server.stop(grace)


async def start_local_system(
    *,
    host: str = "127.0.0.1",
    registry_port: int = 0,
    invocation_port: int = 0,
    bridge_port: int = 0,
    web_port: int = 0,
    web_origins: Sequence[str] = (),
    web_hosts: Sequence[str] = (),
    heartbeat_s: float = 5.0,
    policy: LedgerPolicy | None = None,
    max_in_flight: int | None = None,
    security: Security = LOOPBACK,
    store_url: str = MEMORY,
    store_prefix: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> LocalSystem:
    """All three services; their internal listeners on free loopback ports, used only by each other.

    The registry and the invocation service keep their state at `store_url`. With tokens on and no
    service token configured, the services get a random one (Security.with_service_token), so
    that their internal listeners admit each other only. Raises CannotListen (having stopped
    those started) when a port is taken.
    """
    security = security.with_service_token()
    for port in (registry_port, invocation_port, bridge_port, web_port):
        security.check_public(f"{host}:{port}")
    # One web port for pages: the bridge's host RPCs, the registry's reads, the invocation service's calls.
    web_routes = WebRoutes()
    registry = await start_registry(
        f"{host}:{registry_port}",
        open_stores(store_url, store_prefix),
        security=security,
        limits=limits,
        web_routes=web_routes,
    )
    try:
        bridge, router = await start_bridge(
            f"{host}:{bridge_port}",
            heartbeat_s,
            registry_target=f"127.0.0.1:{registry.internal_port}",
            web_address=f"{host}:{web_port}",
            web_origins=web_origins,
            web_hosts=web_hosts,
            security=security,
            stores=None if store_url == MEMORY else open_stores(store_url, store_prefix),
            limits=limits,
            web_routes=web_routes,
        )
    except BaseException:
        await registry.stop(0)
        raise
    try:
        invocation = await start_invocation(
            f"127.0.0.1:{registry.internal_port}",
            f"127.0.0.1:{bridge.internal_port}",
            f"{host}:{invocation_port}",
            stores=open_stores(store_url, store_prefix),
            policy=policy,
            max_in_flight=max_in_flight,
            security=security,
            limits=limits,
            web_routes=web_routes,
        )
    except BaseException:
        await bridge.stop(0)
        await registry.stop(0)
        raise
    return LocalSystem(
        registry, invocation, bridge, router, host, web_tls=security.serves_tls, security=security
    )


async def start_replicas(
    system: LocalSystem,
    count: int,
    store_url: str,
    store_prefix: str | None = None,
    *,
    security: Security | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> list[RunningServer]:
    """`count` more replicas of each service beside `system`, on free ports, keeping their state in
    the same shared store (a Redis: replicas share nothing else). Each invocation replica uses its
    own registry replica and, for sessions without a route, its own bridge replica. Their security
    is the system's (its service token included) unless given."""
    security = system.security if security is None else security
    started: list[RunningServer] = []
    try:
        for _ in range(count):
            registry = await start_registry(
                f"{system.host}:0", open_stores(store_url, store_prefix), security=security, limits=limits
            )
            started.append(registry)
            registry_internal = f"127.0.0.1:{registry.internal_port}"
            bridge, _ = await start_bridge(
                f"{system.host}:0",
                registry_target=registry_internal,
                security=security,
                stores=open_stores(store_url, store_prefix),
                limits=limits,
            )
            started.append(bridge)
            invocation = await start_invocation(
                registry_internal,
                f"127.0.0.1:{bridge.internal_port}",
                f"{system.host}:0",
                stores=open_stores(store_url, store_prefix),
                security=security,
                limits=limits,
            )
            started.append(invocation)
    except BaseException:
        for server in reversed(started):
            await server.stop(0)
        raise
    return started
