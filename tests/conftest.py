"""Shared fixtures: real servers on free ports, real host processes."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from redis_testing import LocalCluster, RedisServer
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.core import event_loop
from toolmesh_testing import HostProcess, start_host_process

KINDS = ("unit", "integration")

# Started in the background by a shell without job control (`cmd &` in a script), the test process
# ignores SIGINT, and the programs it starts inherit that: a host a test stops with Ctrl-C would
# never stop. They are started with Ctrl-C as a terminal delivers it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a test that is not exactly one of unit or integration, or slow but not integration."""
    kinds = [kind for kind in KINDS if item.get_closest_marker(kind) is not None]
    if len(kinds) != 1 or (item.get_closest_marker("slow") is not None and kinds != ["integration"]):
        pytest.fail(
            f"mark the test unit or integration (a slow one integration); it is {kinds}", pytrace=False
        )


# Unset, the tests' own loops are pytest-asyncio's default (the standard loop, as most programs that
# embed the client SDK run), and every process they start runs on uvloop, the services' default: a run
# covers both loops. TOOLMESH_EVENT_LOOP=uvloop or asyncio puts the tests' loops and (the variable
# inherited) every process they start on that one loop.
_LOOP_FACTORY = event_loop.loop_factory() if os.environ.get(event_loop.ENV, "").strip() else None
if _LOOP_FACTORY is not None:

    def pytest_asyncio_loop_factories(
        config: pytest.Config, item: pytest.Item
    ) -> dict[str, Callable[[], Any]]:
        assert _LOOP_FACTORY is not None
        return {os.environ[event_loop.ENV]: _LOOP_FACTORY}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system() -> AsyncIterator[LocalSystem]:
    running = await start_local_system(heartbeat_s=0.5)
    yield running
    await running.stop(grace=0.5)


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("markers")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def e2e_host(system: LocalSystem, marker_dir: Path) -> AsyncIterator[HostProcess]:
    """A `toolmesh host` process serving thread "e2e" with the handlers of e2e_handlers.py."""
    host = await start_host_process(system.bridge_target, "e2e", "e2e_handlers:HANDLERS", marker_dir)
    yield host
    await host.stop()


@pytest.fixture
def cli_env(system: LocalSystem) -> Iterator[dict[str, str]]:
    env = dict(os.environ)
    env.update(
        TOOLMESH_REGISTRY_ADDR=system.registry_target,
        TOOLMESH_INVOCATION_ADDR=system.invocation_target,
        TOOLMESH_BRIDGE_ADDR=system.bridge_target,
    )
    yield env


@pytest_asyncio.fixture
async def redis_server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    """A redis-server of the test's own (RedisServer), to kill and start again."""
    server = RedisServer(tmp_path)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A Redis Cluster of three primaries, each with a replica, on free ports, for this test process
    (started on first use)."""
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
