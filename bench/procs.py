"""Child processes of a benchmark run: start, wait until ready, read memory, stop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PORT_LINE = re.compile(r"listening on port (\d+)")
# Printed before PORT_LINE by services with an internal listener (registry, bridge).
INTERNAL_PORT_LINE = re.compile(r"internal listener on port (\d+)")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port nothing listens on, for a process started (and perhaps restarted) on it.

    Taken below the kernel's ephemeral range: a port from that range, once the probe closes it, can
    become the local end of any outgoing connection before its process binds it, or while a killed
    process restarts on it.
    """
    top = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(10000, top)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@dataclass
class Proc:
    """A child process whose output is drained into a short buffer (for diagnostics)."""

    name: str
    process: asyncio.subprocess.Process
    lines: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=400))
    _drains: list[asyncio.Task[None]] = field(default_factory=list)
    port: int = 0
    # Output lines that start with `counted_prefix`, by their text.
    counted_prefix: str | None = None
    counted: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def internal_target(self) -> str:
        """The address of the service's internal listener, from the line it printed."""
        return f"127.0.0.1:{(await self.wait_for(INTERNAL_PORT_LINE)).group(1)}"

    async def wait_for(self, pattern: re.Pattern[str] | str, timeout: float = 30.0) -> re.Match[str]:
        """The first output line (stdout or stderr) matching `pattern`."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        seen = 0

        async def scan() -> re.Match[str]:
            nonlocal seen
            while True:
                for line in list(self.lines)[seen:]:
                    found = regex.search(line)
                    if found is not None:
                        return found
                seen = len(self.lines)
                if self.process.returncode is not None and all(d.done() for d in self._drains):
                    raise RuntimeError(f"{self.name} exited ({self.process.returncode}): {self.tail()}")
                await asyncio.sleep(0.02)

        try:
            return await asyncio.wait_for(scan(), timeout)
        except TimeoutError:
            raise RuntimeError(f"{self.name} did not print {regex.pattern!r}: {self.tail()}") from None

    def tail(self, count: int = 20) -> str:
        return "".join(list(self.lines)[-count:])

    async def stop(self, timeout: float = 15.0) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        for drain in self._drains:
            with contextlib.suppress(asyncio.CancelledError):
                await drain


async def start(
    name: str,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    port_line: bool = True,
    counted_prefix: str | None = None,
    ready_s: float = 30.0,
    log: Path | None = None,
) -> Proc:
    """Start `python ARGS` in the repository root; when `port_line`, wait up to `ready_s` for its
    port announcement. With `log`, its output is also appended to that file."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    proc = Proc(name, process, counted_prefix=counted_prefix)
    kept = None if log is None else log.open("a", encoding="utf-8")
    if kept is not None:
        kept.write(f"--- {name} started, pid {process.pid}, at {time.time():.3f}\n")

    async def drain(stream: asyncio.StreamReader | None) -> None:
        assert stream is not None
        async for line in stream:
            text = line.decode(errors="replace")
            proc.lines.append(text)
            if kept is not None:
                kept.write(text)
            if proc.counted_prefix and text.startswith(proc.counted_prefix):
                proc.counted[text.strip()] += 1

    proc._drains = [
        asyncio.create_task(drain(process.stdout)),
        asyncio.create_task(drain(process.stderr)),
    ]
    if kept is not None:
        # Closed once both streams have ended (the process exited, or was killed).
        ended = asyncio.gather(*proc._drains, return_exceptions=True)
        ended.add_done_callback(lambda _: kept.close())
    if port_line:
        try:
            proc.port = int((await proc.wait_for(PORT_LINE, ready_s)).group(1))
        except BaseException:
            await proc.stop()
            raise
    return proc


async def stop_all(procs: list[Proc]) -> None:
    # Callers first: the list is in start order, so stop it backwards.
    for proc in reversed(procs):
        await proc.stop()


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak so far) of a process, in KiB."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def children(pid: int, marker: str) -> list[int]:
    """Child processes of `pid` whose command line contains `marker`."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline:
                found.append(int(child))
    return found


def extract(ref: str, directory: Path) -> tuple[str, dict[str, str]]:
    """The services and SDK of commit `ref` (`git archive` into `directory`): its short sha, and
    the environment that makes a process run them (PYTHONPATH first; bench.* still from here)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", ref], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", ref, "clients/python/src", "services/src"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    path = [directory / "clients/python/src", directory / "services/src", REPO]
    return sha, {"PYTHONPATH": os.pathsep.join(map(str, path))}
