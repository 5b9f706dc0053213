"""Redis for tests: the shared server (each test under its own key prefix) and private servers to kill."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError

# The shared Redis every test that needs one uses; never flushed, only our prefixes are removed.
SHARED_URL = os.environ.get("TOOLMESH_TEST_REDIS", "redis://127.0.0.1:6379/0")


def new_prefix() -> str:
    return f"test:{uuid.uuid4().hex}:"


def _unbound_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        if self.port:
            await self._launch(self.port)
            return
        for _ in range(10):
            try:
                await self._launch(_unbound_port())
                return
            except AssertionError:
                if self.process is None or self.process.returncode is None:
                    raise  # not a bind failure: it is up but does not answer
                self.port = 0  # it exited: the port was taken, try another
        raise AssertionError("redis-server found no free port in 10 tries")

    async def _launch(self, port: int) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *server_command(port, self.directory, "--appendonly", "yes", "--appendfsync", "always"),
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
    persistence: a test that needs data to survive uses RedisServer."""

    directory: Path
    primaries: int = 3
    replicas: int = 0
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
                port = _unbound_port()
                process = subprocess.Popen(
                    server_command(
                        port,
                        node,
                        *("--appendonly", "no", "--cluster-enabled", "yes", "--cluster-node-timeout", "1000"),
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
        deadline = time.monotonic() + 30
        while not all(b"cluster_state:ok" in _cli(port, "CLUSTER", "INFO") for port in self.ports):
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.1)

    def stop(self) -> None:
        for process in self.processes:
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
