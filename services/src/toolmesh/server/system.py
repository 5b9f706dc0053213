"""Assembling the three services, alone or together on the embedded default."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from toolmesh.bridge.router import Router
from toolmesh.bridge.servicer import bridge_service
from toolmesh.core.channels import open_channel
from toolmesh.invocation.catalog_cache import cached_registry_catalog
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.ledger import Ledger, LedgerPolicy
from toolmesh.invocation.remote import RemoteDispatcher
from toolmesh.invocation.servicer import invocation_service
from toolmesh.registry.catalog import Registry
from toolmesh.registry.servicer import registry_service
from toolmesh.server.runtime import RunningServer, start_server
from toolmesh.server.security import LOOPBACK, Security
from toolmesh.store.base import Store
from toolmesh.store.memory import InMemoryStore

# Internal listeners on a free loopback port unless told otherwise.
INTERNAL_ADDRESS = "127.0.0.1:0"


async def start_registry(
    address: str = "127.0.0.1:0",
    store: Store | None = None,
    *,
    security: Security = LOOPBACK,
    internal_address: str = INTERNAL_ADDRESS,
) -> RunningServer:
    registry = Registry(store if store is not None else InMemoryStore())
    return await start_server(
        [registry_service(registry)], address, security=security, internal_address=internal_address
    )


async def start_bridge(
    address: str = "127.0.0.1:0",
    heartbeat_s: float = 5.0,
    *,
    security: Security = LOOPBACK,
    internal_address: str = INTERNAL_ADDRESS,
) -> tuple[RunningServer, Router]:
    router = Router(heartbeat_s=heartbeat_s)
    server = await start_server(
        [bridge_service(router)], address, security=security, internal_address=internal_address
    )
    return server, router


async def start_invocation(
    registry_target: str,
    bridge_target: str,
    address: str = "127.0.0.1:0",
    *,
    store: Store | None = None,
    policy: LedgerPolicy | None = None,
    max_in_flight: int = 20_000,
    security: Security = LOOPBACK,
) -> RunningServer:
    """The invocation service; `registry_target` and `bridge_target` are their internal listeners."""
    security.check_public(address)
    registry_channel = open_channel(registry_target, security.peer_credentials())
    bridge_channel = open_channel(bridge_target, security.peer_credentials())
    ledger = Ledger(store if store is not None else InMemoryStore(), policy or LedgerPolicy())
    # Each session's tools from a registry watch, GetTool only for names not in it.
    catalog = cached_registry_catalog(registry_target, registry_channel)
    dispatcher = RemoteDispatcher(bridge_channel)
    invoker = Invoker(catalog, dispatcher, ledger, max_in_flight)
    running = await start_server([invocation_service(invoker)], address, security=security)
    running.after_stop += [catalog.aclose, registry_channel.close, dispatcher.aclose, bridge_channel.close]
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
    heartbeat_s: float = 5.0,
    policy: LedgerPolicy | None = None,
    max_in_flight: int = 20_000,
    security: Security = LOOPBACK,
) -> LocalSystem:
    """All three services; their internal listeners on free loopback ports, used only by each other."""
    for port in (registry_port, invocation_port, bridge_port):
        security.check_public(f"{host}:{port}")
    registry, (bridge, router) = await asyncio.gather(
        start_registry(f"{host}:{registry_port}", security=security),
        start_bridge(f"{host}:{bridge_port}", heartbeat_s, security=security),
    )
    try:
        invocation = await start_invocation(
            f"127.0.0.1:{registry.internal_port}",
            f"127.0.0.1:{bridge.internal_port}",
            f"{host}:{invocation_port}",
            policy=policy,
            max_in_flight=max_in_flight,
            security=security,
        )
    except BaseException:
        await asyncio.gather(registry.stop(0), bridge.stop(0))
        raise
    return LocalSystem(registry, invocation, bridge, router, host)
