"""Helpers for the tests: awaiting a condition, and real `toolmesh` processes and services."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

import grpc
import uvloop
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from bench.procs import free_port
from toolmesh.core import event_loop
from toolmesh.core.calls import ToolRequest
from toolmesh.core.outcome import Outcome
from toolmesh.core.tools import ToolSpec
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, tool_pb2

# The tests' helper files (handler modules, peers, lock files) and the repository they test.
SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]

T = TypeVar("T")

# The two event loops a toolmesh process may run on (toolmesh.core.event_loop), by name.
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def run_on(loop: str, main: Coroutine[Any, Any, T]) -> T:
    """`main` to its end on a new event loop of the kind `loop` names (LOOPS)."""
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(main)


@overload
async def eventually(
    condition: Callable[[], Awaitable[T | None]],
    *,
    timeout: float = ...,
    interval: float = ...,
    message: str = ...,
) -> T: ...
@overload
async def eventually(
    condition: Callable[[], T | None], *, timeout: float = ..., interval: float = ..., message: str = ...
) -> T: ...
async def eventually(
    condition: Callable[[], Any],
    *,
    timeout: float = 10.0,
    interval: float = 0.01,
    message: str = "",
) -> Any:
    """Poll `condition` until it holds and return what it returned: a wait for a condition, not a sleep.

    `condition` (plain or async) holds when it returns a truthy value; a falsy
    value or an AssertionError means "not yet". Once `timeout` seconds have
    passed, the last AssertionError is raised, or one saying `message`.
    """
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while True:
        try:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            failure = AssertionError(
                message or f"never held: {getattr(condition, '__qualname__', condition)}"
            )
        except AssertionError as not_yet:
            failure = not_yet
        if loop.time() >= give_up:
            raise failure
        await asyncio.sleep(interval)


def logged(records: Iterable[logging.LogRecord], message: str) -> int:
    """How many of `records` (e.g. caplog.records) have the message `message`."""
    return sum(record.getMessage() == message for record in records)


@dataclass
class HostProcess:
    process: asyncio.subprocess.Process
    stderr_lines: list[str] = field(default_factory=list)
    _reader: asyncio.Task[None] | None = None

    def logs(self) -> list[dict[str, Any]]:
        """The host's JSON log records so far."""
        records = []
        for line in self.stderr_lines:
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
        return records

    async def wait_for_log(self, timeout: float = 10.0, **fields: str) -> dict[str, Any]:
        """The first JSON log record whose fields include `fields`."""

        def found() -> dict[str, Any] | None:
            for record in self.logs():
                if all(record.get(key) == value for key, value in fields.items()):
                    return record
            if self._reader is not None and self._reader.done():
                raise RuntimeError(f"host exited without logging {fields}: {self.stderr_lines}")
            return None

        return await eventually(found, timeout=timeout, message=f"no log record with {fields}")

    async def stop(self) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self._reader is not None:
            await self._reader
        assert self.process.returncode is not None
        return self.process.returncode

    def kill(self) -> None:
        self.process.kill()


async def start_host_process(
    bridge_target: str, thread_id: str, handlers: str, marker_dir: Path, env: dict[str, str] | None = None
) -> HostProcess:
    env = dict(env or os.environ, TOOLMESH_TEST_MARKERS=str(marker_dir))
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "host",
        "--thread-id",
        thread_id,
        "--handlers",
        handlers,
        "--bridge",
        bridge_target,
        cwd=SUPPORT,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    host = HostProcess(process)

    async def read() -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            host.stderr_lines.append(line.decode(errors="replace"))

    host._reader = asyncio.create_task(read())
    await host.wait_for_log(msg="host ready", timeout=20)
    return host


def environment_without_settings() -> dict[str, str]:
    """This process's environment without its TOOLMESH_ settings, but for the event loop's choice.

    TOOLMESH_EVENT_LOOP stays so that a run of the suite on uvloop puts every process it starts on uvloop too.
    """
    kept = (key for key in os.environ if not key.startswith("TOOLMESH_") or key == event_loop.ENV)
    return {key: os.environ[key] for key in kept}


def toolmesh_command() -> list[str]:
    return [sys.executable, "-m", "toolmesh.cli.main"]


def run_to_end(*args: str, timeout: float = 220) -> subprocess.CompletedProcess[str]:
    """Run `python ARGS` in the repository to its end and require exit 0 (its stderr's tail says why not)."""
    completed = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


async def run_cli(*args: str, env: dict[str, str], timeout: float = 30.0) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=SUPPORT,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


@dataclass
class ServiceProcess:
    process: asyncio.subprocess.Process
    port: int
    output: list[str] = field(default_factory=list)
    _reader: asyncio.Task[None] | None = None
    # The internal listener (registry and bridge), for the invocation service.
    internal_port: int | None = None
    # The bridge's web port (Connect, gRPC-Web), when it serves pages.
    web_port: int | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def internal_target(self) -> str:
        assert self.internal_port is not None
        return f"127.0.0.1:{self.internal_port}"

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.process.wait(), 15)
        if self._reader is not None:
            await self._reader


INTERNAL_LISTENERS = ("registry", "bridge")


async def start_service_process(
    service: str,
    *args: str,
    env: dict[str, str] | None = None,
    listen: str | None = None,
    internal_listen: str | None = None,
    ports: dict[str, int] | None = None,
) -> ServiceProcess:
    """`python -m toolmesh.<service> --listen LISTEN [--internal-listen ...] ...`, with its ports and all
    it prints.

    Every listener binds port 0 and reports the port it got, unless told otherwise. With `ports`,
    the service listens where `ports` says (`<service>`, `<service>-internal`, `<service>-web`;
    a name missing: a free port below the ephemeral range, which no outgoing connection takes
    while the service is down) and the ports it bound are written back, so that a restart with
    the same `ports` comes back on the same addresses. A bridge's web port is a free one too,
    unless `args` name it.
    """

    def chosen(name: str) -> int:
        if ports is None:
            return 0
        return ports.get(name) or free_port()

    listen = listen or f"127.0.0.1:{chosen(service)}"
    if service == "bridge" and "--web-listen" not in args:
        args = ("--web-listen", f"127.0.0.1:{chosen('bridge-web')}", *args)
    internal = []
    if service in INTERNAL_LISTENERS:
        internal = ["--internal-listen", internal_listen or f"127.0.0.1:{chosen(f'{service}-internal')}"]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        f"toolmesh.{service}",
        "--listen",
        listen,
        *internal,
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    output: list[str] = []
    internal_port = web_port = None
    while True:
        line = (await asyncio.wait_for(process.stdout.readline(), 20)).decode()
        if not line:
            raise AssertionError(f"{service} exited: {output}")
        output.append(line)
        if "internal listener on port" in line:
            internal_port = int(line.rsplit(" ", 1)[1])
        if "serves pages" in line:
            web_port = int(line.rsplit(" ", 1)[1])
        if "listening on port" in line:
            break
    running = ServiceProcess(
        process, int(line.rsplit(" ", 1)[1]), output, internal_port=internal_port, web_port=web_port
    )
    if ports is not None:
        ports[service] = running.port
        for suffix, port in (("internal", internal_port), ("web", web_port)):
            if port is not None:
                ports[f"{service}-{suffix}"] = port

    async def read() -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            output.append(raw.decode(errors="replace"))

    running._reader = asyncio.create_task(read())
    return running


# Bound, never listening, held until the process ends: a connection there is refused at once,
# and no other server can take the port meanwhile (a port bound then closed could be taken).
_CLOSED: list[socket.socket] = []


def closed_address() -> str:
    """An address on this machine where nothing listens, nor will while the tests run."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _CLOSED.append(sock)
    return f"127.0.0.1:{sock.getsockname()[1]}"


async def refused_start(service: str, *args: str, env: dict[str, str]) -> tuple[int | None, str]:
    """`python -m toolmesh.<service>` on free loopback ports that is expected to exit at once:
    its exit code and stderr."""
    internal = ["--internal-listen", "127.0.0.1:0"] if service in INTERNAL_LISTENERS else []
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        f"toolmesh.{service}",
        "--listen",
        "127.0.0.1:0",
        *internal,
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=SUPPORT,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode, stderr.decode()


# The standard services' methods, made as their generated stubs make them: the stubs'
# typing leaves the methods out.


def health_check(
    channel: grpc.aio.Channel,
) -> grpc.aio.UnaryUnaryMultiCallable[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]:
    """grpc.health.v1.Health/Check on `channel`."""
    return channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )


def reflection_info(
    channel: grpc.aio.Channel, version: str = "v1alpha"
) -> grpc.aio.StreamStreamMultiCallable[
    reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse
]:
    """grpc.reflection.<version>.ServerReflection/ServerReflectionInfo on `channel` (v1's messages are
    v1alpha's on the wire)."""
    return channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )


class OneTool:
    """A catalog with every tool there is (any name), for unit tests of the invoker alone."""

    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        return ToolSpec(name, "", '{"type": "object"}', timeout_ms=5000)


class SlowHost:
    """Stands in for the bridge in a unit test of the invoker alone: calls wait until `release`."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def dispatch(self, request: ToolRequest, on_progress: object = None) -> Outcome:
        self.started += 1
        await self.release.wait()
        return Outcome.success("1")


@contextlib.asynccontextmanager
async def bridge_stubs(server: Any) -> AsyncIterator[tuple[Any, Any]]:
    """BridgeService stubs on a started bridge's public and internal listeners (a RunningServer)."""
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as public,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.internal_port}") as internal,
    ):
        yield bridge_pb2_grpc.BridgeServiceStub(public), bridge_pb2_grpc.BridgeServiceStub(internal)


async def dispatch_together(internal: Any, requests: list[bridge_pb2.ToolRequest]) -> dict[str, str]:
    """`requests` in one DispatchToolRequests message to a bridge's internal stub, as the invocation
    service sends the calls that are ready together: each one's result JSON, by tool request id."""
    dispatch = internal.DispatchToolRequests()
    await dispatch.write(bridge_pb2.DispatchToolRequestsRequest(requests=requests))
    answered: dict[str, str] = {}
    while len(answered) < len(requests):
        response = await asyncio.wait_for(dispatch.read(), 10)
        for result in response.results:
            answered[result.tool_request_id] = result.outcome.result_json
    dispatch.cancel()
    return answered


class AskingHost:
    """A raw host session of `session_id` for `handler_names` that acknowledges starts and asks
    START only for the requests the test names; it runs nothing, and hands in what the test says.
    With `acknowledges_starts` False it asks nothing: it only reads its stream, so the test knows
    which requests its bridge replica holds."""

    def __init__(
        self,
        bridge_target: str,
        session_id: str,
        handler_names: list[str],
        *,
        acknowledges_starts: bool = True,
    ) -> None:
        self._channel = grpc.aio.insecure_channel(bridge_target)
        self._stub = bridge_pb2_grpc.BridgeServiceStub(self._channel)
        opening = bridge_pb2.OpenHostSessionRequest(
            session_id=session_id,
            host_name="asking",
            handler_names=handler_names,
            acknowledges_starts=acknowledges_starts,
        )
        self._acknowledges_starts = acknowledges_starts
        self._stream = self._stub.OpenHostSession(opening)
        self.opened: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # The ids of the requests it was sent, and of those the bridge cancelled, in order.
        self.received: list[str] = []
        self.cancelled: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for event in self._stream:
                if event.HasField("opened") and not self.opened.done():
                    assert event.opened.starts_acknowledged == self._acknowledges_starts
                    self.opened.set_result(event.opened.host_session_id)
                elif event.HasField("tool_request"):
                    self.received.append(event.tool_request.tool_request_id)
                elif event.HasField("tool_requests"):
                    self.received.extend(request.tool_request_id for request in event.tool_requests.requests)
                elif event.HasField("cancelled"):
                    self.cancelled.append(event.cancelled.tool_request_id)

    async def start(self, tool_request_id: str) -> bridge_pb2.ToolStartVerdict.ValueType:
        request = bridge_pb2.StartToolRequestsRequest(
            host_session_id=await self.opened, tool_request_ids=[tool_request_id]
        )
        [start] = (await self._stub.StartToolRequests(request, timeout=10)).starts
        return start.verdict

    async def submit(self, tool_request_id: str, result_json: str) -> None:
        """Hand in a result (raises as SubmitToolResult does when it is refused)."""
        await self._stub.SubmitToolResult(
            bridge_pb2.SubmitToolResultRequest(
                host_session_id=await self.opened,
                tool_request_id=tool_request_id,
                outcome=tool_pb2.ToolOutcome(result_json=result_json),
            ),
            timeout=10,
        )

    async def close(self) -> None:
        self._stream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._channel.close()
