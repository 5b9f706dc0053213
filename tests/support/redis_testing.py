"""Redis for tests: the shared server (each test under its own key prefix) and private servers to kill."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError

from bench.procs import free_port

# The shared Redis every test that needs one uses; never flushed, only our prefixes are removed.
SHARED_URL = os.environ.get("TOOLMESH_TEST_REDIS", "redis://127.0.0.1:6379/0")


def new_prefix() -> str:
    return f"test:{uuid.uuid4().hex}:"


def server_command(port: int, directory: Path, *options: str) -> list[str]:
    """A redis-server on 127.0.0.1:`port` keeping its files in `directory`, no snapshots."""
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed"
    listen = ("--port", str(port), "--bind", "127.0.0.1")
    return [binary, *listen, "--save", "", *options, "--dir", str(directory)]


async def delete_prefixed(url: str, prefix: str) -> None:
    """Remove every key under `prefix` (what one test wrote)."""
    client = Redis.from_url(url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.unlink(*keys)
    finally:
        await client.aclose()


@dataclass
class RedisServer:
    """A redis-server of a test's own, persisting to `directory` (append-only file, fsync on every
    write), so that it can be killed and started again with its data, on the same port.

    redis-server cannot bind port 0 and report the port it got, so with `port` 0 the first start
    tries free ports until one binds (another process may take a port between its choice and
    the bind); a restart keeps the port.
    """

    directory: Path
    port: int = 0
    process: asyncio.subprocess.Process | None = None
    # More redis-server options (e.g. "--replicaof", host, port).
    options: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        if self.port:
            await self._launch(self.port)
            return
        for _ in range(10):
            try:
                await self._launch(free_port())
                return
            except AssertionError:
                if self.process is None or self.process.returncode is None:
                    raise  # not a bind failure: it is up but does not answer
                self.port = 0  # it exited: the port was taken, try another
        raise AssertionError("redis-server found no free port in 10 tries")

    async def _launch(self, port: int) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *server_command(
                port, self.directory, "--appendonly", "yes", "--appendfsync", "always", *self.options
            ),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        self.port = port
        await self.wait_ready()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        async def ping() -> None:
            while True:
                client = Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
                try:
                    if await client.ping():
                        return
                except (RedisError, OSError):  # not up yet: refused, or still loading its file
                    assert self.process is not None and self.process.returncode is None, "redis-server exited"
                    await asyncio.sleep(0.02)
                finally:
                    await client.aclose()

        await asyncio.wait_for(ping(), timeout_s)

    async def kill(self) -> None:
        """SIGKILL: what a crash or a lost machine looks like to the clients."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        await self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: a server that keeps its connections open and answers nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.resume()
            await self.kill()


@dataclass
class LocalCluster:
    """A Redis Cluster of the tests' own: `primaries` redis-server processes in cluster mode on free
    ports (each with `replicas` replicas), slots spread by `redis-cli --cluster create`. No
    persistence: a test that needs data to survive uses RedisServer.

    A node that misses its pings for `node_timeout_ms` is failed, and its replica promoted: a
    primary killed here is replaced in two to four seconds (redis-server's default timeout is 15 s;
    much lower and a machine busy with other tests would see failovers of nodes that are up).
    """

    directory: Path
    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self) -> None:
        for index in range(self.primaries * (1 + self.replicas)):
            node = self.directory / f"node{index}"
            node.mkdir(parents=True, exist_ok=True)
            for _ in range(10):
                port = free_port()
                process = subprocess.Popen(
                    server_command(
                        port,
                        node,
                        *("--appendonly", "no", "--cluster-enabled", "yes"),
                        *("--cluster-node-timeout", str(self.node_timeout_ms)),
                        *("--cluster-config-file", str(node / "nodes.conf")),
                    ),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                if _answers(port, process):
                    self.processes.append(process)
                    self.ports.append(port)
                    break
                process.kill()
                process.wait()
            else:
                raise AssertionError("redis-server found no free port in 10 tries")
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 30) -> None:
        """Until every live node sees the cluster ok and every live replica is in sync with its primary."""
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.1)

    def _healthy(self) -> bool:
        live = self.live_ports()
        if not all(b"cluster_state:ok" in _cli(port, "CLUSTER", "INFO") for port in live):
            return False
        replicas = 0
        for port in live:
            info = _cli(port, "INFO", "replication")
            if b"role:slave" in info:
                if b"master_link_status:up" not in info:
                    return False
                replicas += 1
        # Every node knows every live replica as one (a client's slot map lists them).
        for port in live:
            nodes = _cli(port, "CLUSTER", "NODES").decode().splitlines()
            flags = [line.split()[2].split(",") for line in nodes if line.strip()]
            if sum("slave" in flag and "fail" not in flag for flag in flags) != replicas:
                return False
        return True

    def live_ports(self) -> list[int]:
        return [
            port for port, process in zip(self.ports, self.processes, strict=True) if process.poll() is None
        ]

    def primary_ports(self) -> list[int]:
        """The ports of the nodes serving slots now (as the first live node sees it)."""
        return [port for port, role in self.roles().items() if role == "master"]

    def roles(self) -> dict[int, str]:
        """Each live node's role by port: "master" or "slave" (its own word)."""
        roles = {}
        for port in self.live_ports():
            info = _cli(port, "INFO", "replication").decode()
            roles[port] = next(
                line.split(":")[1].strip() for line in info.splitlines() if line.startswith("role:")
            )
        return roles

    def primary_of(self, slot: int) -> int:
        """The port of the primary that serves `slot` now."""
        for port in self.primary_ports():
            for line in _cli(port, "CLUSTER", "NODES").decode().splitlines():
                fields = line.split()
                if "myself" not in fields[2]:
                    continue
                for served in fields[8:]:
                    first, _, last = served.partition("-")
                    if first.isdigit() and int(first) <= slot <= int(last or first):
                        return port
        raise AssertionError(f"no primary serves slot {slot}")

    def replica_of(self, primary: int) -> int:
        """The port of a live replica of the primary on `primary`."""
        for line in _cli(primary, "CLUSTER", "REPLICAS", self.node_id(primary)).decode().splitlines():
            port = int(line.split()[1].split("@")[0].rpartition(":")[2])
            if port in self.live_ports():
                return port
        raise AssertionError(f"the primary on {primary} has no live replica")

    def cut_replication(self, primary: int) -> None:
        """Close the primary's connections to its replicas (a replica stopped meanwhile cannot come
        back for what the primary writes next: a lagging replica, to a failover)."""
        _cli(primary, "CLIENT", "KILL", "TYPE", "replica")

    def take_over(self, replica: int) -> None:
        """Promote the replica on `replica` at once (CLUSTER FAILOVER TAKEOVER: no vote, as when its
        primary is lost), then wait until the cluster is healthy again."""
        assert b"OK" in _cli(replica, "CLUSTER", "FAILOVER", "TAKEOVER")
        self.wait_healthy()
        assert replica in self.primary_ports()

    def move_slot(self, slot: int, target: int) -> None:
        """Migrate `slot` to the primary on `target` as `redis-cli --cluster reshard` does, a key at a
        time (so that clients meet it half moved: ASK, TRYAGAIN), then give it to the target."""
        source = self.primary_of(slot)
        source_id, target_id = self.node_id(source), self.node_id(target)
        _cli(target, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
        _cli(source, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
        while keys := _cli(source, "CLUSTER", "GETKEYSINSLOT", str(slot), "1").decode().split():
            moved = _cli(source, "MIGRATE", "127.0.0.1", str(target), "", "0", "5000", "KEYS", *keys)
            assert b"OK" in moved or b"NOKEY" in moved, moved
        for port in [target, source, *(p for p in self.primary_ports() if p not in (source, target))]:
            _cli(port, "CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
        self.wait_healthy()

    def node_id(self, port: int) -> str:
        return _cli(port, "CLUSTER", "MYID").decode().strip()

    def kill(self, port: int) -> None:
        """SIGKILL the node on `port`: a crashed or lost machine, to the cluster and its clients."""
        process = self.processes[self.ports.index(port)]
        process.send_signal(signal.SIGKILL)
        process.wait()

    def pause(self, port: int) -> None:
        """SIGSTOP: a node that keeps its connections and answers nothing (a replica that lags)."""
        self.processes[self.ports.index(port)].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.processes[self.ports.index(port)].send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait()


def _cli(port: int, *command: str) -> bytes:
    return subprocess.run(
        ["redis-cli", "-p", str(port), *command], capture_output=True, timeout=10, check=False
    ).stdout


def _answers(port: int, process: subprocess.Popen[bytes]) -> bool:
    """Whether the server started on `port` (False: it exited, the port was taken)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if b"PONG" in _cli(port, "PING"):
            return True
        time.sleep(0.02)
    raise AssertionError("redis-server does not answer")
