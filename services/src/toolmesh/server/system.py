"""Assembling the three services, alone or together on the embedded default."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from toolmesh.bridge.declarations import Declarations
from toolmesh.bridge.observability import RouterTelemetry
from toolmesh.bridge.registry_lists import RegistryToolLists
from toolmesh.bridge.router import Router
from toolmesh.bridge.servicer import bridge_service
from toolmesh.bridge.web import start_web_server, web_app
from toolmesh.core.channels import open_channel
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.ledger import Ledger, LedgerPolicy
from toolmesh.invocation.observability import InvocationTelemetry
from toolmesh.invocation.remote import RemoteDispatcher, cached_registry_catalog
from toolmesh.invocation.servicer import invocation_service
from toolmesh.registry.registry import Registry
from toolmesh.registry.servicer import registry_service
from toolmesh.server.runtime import CannotListen, RunningServer, start_server
from toolmesh.store.base import Store
from toolmesh.store.memory import InMemoryStore


async def start_registry(address: str = "127.0.0.1:0", store: Store | None = None) -> RunningServer:
    registry = Registry(store if store is not None else InMemoryStore())
    return await start_server([registry_service(registry)], address)


async def start_bridge(
    address: str = "127.0.0.1:0",
    heartbeat_s: float = 5.0,
    *,
    registry_target: str | None = None,
    web_address: str | None = None,
    web_origins: Sequence[str] = (),
) -> tuple[RunningServer, Router]:
    """The bridge on `address`, and on `web_address` for pages (Connect, gRPC-Web) when given.

    With `registry_target`, hosts may declare their tools (DeclareHostTools);
    `web_origins` are the browser origins allowed besides the web port's own.
    """
    router = Router(heartbeat_s=heartbeat_s, observer=RouterTelemetry())
    lists = RegistryToolLists(registry_target) if registry_target is not None else None
    declarations = Declarations(router, lists)
    service = bridge_service(router, declarations)
    running = await start_server([service], address)
    if lists is not None:
        running.after_stop.append(lists.aclose)
    if web_address is not None:
        try:
            web = await start_web_server(web_app(router, declarations, web_origins), web_address)
        except CannotListen:
            await running.stop(0)
            raise
        running.web_port = web.port
        shutdown = service.on_shutdown

        async def on_shutdown() -> None:
            web.stop_accepting()
            if shutdown is not None:
                await shutdown()

        service.on_shutdown = on_shutdown
        # After the gRPC server's stop: the host streams have ended by then.
        running.after_stop.insert(0, lambda: web.stop(1.0))
    return running, router


async def start_invocation(
    registry_target: str,
    bridge_target: str,
    address: str = "127.0.0.1:0",
    *,
    store: Store | None = None,
    policy: LedgerPolicy | None = None,
    max_in_flight: int = 20_000,
) -> RunningServer:
    registry_channel = open_channel(registry_target)
    bridge_channel = open_channel(bridge_target)
    ledger = Ledger(store if store is not None else InMemoryStore(), policy or LedgerPolicy())
    # Each session's tools from a registry watch, GetTool only for names not in it.
    catalog = cached_registry_catalog(registry_target, registry_channel)
    dispatcher = RemoteDispatcher(bridge_channel)
    invoker = Invoker(catalog, dispatcher, ledger, max_in_flight, observer=InvocationTelemetry())
    closers = [catalog.aclose, registry_channel.close, dispatcher.aclose, bridge_channel.close]
    try:
        running = await start_server([invocation_service(invoker)], address)
    except CannotListen:
        for close in closers:
            await close()
        raise
    running.after_stop += closers
    return running


@dataclass
class LocalSystem:
    """All three services in one process, each on its own port."""

    registry: RunningServer
    invocation: RunningServer
    bridge: RunningServer
    router: Router
    host: str

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
        return f"http://{self.host}:{self.bridge.web_port}"

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
    heartbeat_s: float = 5.0,
    policy: LedgerPolicy | None = None,
    max_in_flight: int = 20_000,
) -> LocalSystem:
    """Start the three services; raises CannotListen (having stopped those started) when a port is taken."""
    started: list[RunningServer] = []
    try:
        registry = await start_registry(f"{host}:{registry_port}")
        started.append(registry)
        bridge, router = await start_bridge(
            f"{host}:{bridge_port}",
            heartbeat_s,
            registry_target=f"{host}:{registry.port}",
            web_address=f"{host}:{web_port}",
            web_origins=web_origins,
        )
        started.append(bridge)
        invocation = await start_invocation(
            f"{host}:{registry.port}",
            f"{host}:{bridge.port}",
            f"{host}:{invocation_port}",
            policy=policy,
            max_in_flight=max_in_flight,
        )
    except CannotListen:
        for server in reversed(started):
            await server.stop(0)
        raise
    return LocalSystem(registry, invocation, bridge, router, host)
