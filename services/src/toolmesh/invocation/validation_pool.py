"""Worker processes that validate JSON against schemas, each job within a time bound.

A validation that could take long must not hold the event loop, which serves
every other session's calls. Such a validation goes to one of a few worker
processes; one that takes longer than its bound has its worker killed
(SIGKILL) and replaced, and only that call is refused. A worker also has its
address space bounded, so a validation that would take gigabytes fails alone.

Workers are `python -m toolmesh.invocation.validation_worker` subprocesses
(not multiprocessing: a fork of a process running gRPC threads is not safe,
and spawn would run the service's own __main__ again), started on first use.
Jobs and replies travel on their stdin and stdout as length-prefixed pickles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import shutil
import struct
import sys
from dataclasses import dataclass, replace
from typing import Any

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.schemas import Violation

log = logging.getLogger("toolmesh.invocation")

FRAME = struct.Struct("!I")
READY = b"ready\n"
WORKER_NICENESS = 10
# Time a worker may take to start, on top of a job's bound, before a job waiting for one is refused.
WORKER_START_S = 5.0


@dataclass(frozen=True, slots=True)
class Job:
    """What one validation needs: the schema's text, and the instance (parsed already, so that the
    worker need not parse it again) or, when it nests too deep to pickle, its text."""

    schema_json: str
    tool: str
    which: str
    require_object: bool
    instance: object
    instance_json: str | None
    all_of_them: bool
    max_schema_bytes: int


class TimedOut(Exception):
    """The validation took longer than its bound; its worker was replaced."""


class OutOfMemory(Exception):
    """The validation needed more memory than a worker has; its worker was replaced."""


class SchemaUnusable(Exception):
    """The schema does not compile here (registered under other rules)."""


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, address_space_bytes: int) -> _Worker:
        # Below the service's priority from the start (its imports included): a long
        # validation, or a worker starting, takes CPU the service's own calls do not wait for.
        nice = shutil.which("nice")
        process = await asyncio.create_subprocess_exec(
            *([nice, "-n", str(WORKER_NICENESS)] if nice else []),
            sys.executable,
            "-m",
            "toolmesh.invocation.validation_worker",
            str(address_space_bytes),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        # It says READY once its imports are done: time a job's bound must not include.
        assert process.stdout is not None
        if await process.stdout.readexactly(len(READY)) != READY:
            raise OSError("a validation worker started wrongly")
        return cls(process)

    async def exchange(self, job: Job) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            body = pickle.dumps(replace(job, instance_json=None), protocol=pickle.HIGHEST_PROTOCOL)
        except RecursionError:
            body = pickle.dumps(replace(job, instance=None), protocol=pickle.HIGHEST_PROTOCOL)
        self.process.stdin.write(FRAME.pack(len(body)) + body)
        await self.process.stdin.drain()
        (size,) = FRAME.unpack(await self.process.stdout.readexactly(FRAME.size))
        return pickle.loads(await self.process.stdout.readexactly(size))

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        await self.process.wait()


class ValidationPool:
    """`workers` processes validating one job each at a time, each job within `timeout_s`."""

    def __init__(self, workers: int, timeout_s: float, address_space_bytes: int) -> None:
        self._size = workers
        self._timeout_s = timeout_s
        self._address_space = address_space_bytes
        self._idle: asyncio.Queue[_Worker] | None = None
        self._all: set[_Worker] = set()
        # Workers starting or being killed.
        self._tasks: set[asyncio.Future[None]] = set()
        self._closed = False

    async def _start(self) -> asyncio.Queue[_Worker]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self._size):
                self._spawn_soon()
        return self._idle

    def _spawn_soon(self) -> None:
        """A new worker joins the idle ones once its process has started and said it is ready.

        One that cannot start is logged, and the pool goes on with one worker fewer.
        """

        async def spawn() -> None:
            worker = await _Worker.start(self._address_space)
            if self._closed:
                await worker.kill()
                return
            self._all.add(worker)
            assert self._idle is not None
            self._idle.put_nowait(worker)

        task = asyncio.ensure_future(spawn())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_spawn_failure)

    async def validate(self, job: Job) -> list[Violation]:
        """The violations (as schemas.violations); TimedOut, OutOfMemory or SchemaUnusable.

        Raises ToolmeshError(OVERLOADED) when no worker frees up within the time bound.
        """
        idle = await self._start()
        try:
            # Longer than a job takes: a worker being replaced takes a moment to start.
            worker = await asyncio.wait_for(idle.get(), self._timeout_s + WORKER_START_S)
        except TimeoutError:
            raise ToolmeshError(
                Code.OVERLOADED, "Every validation worker is busy.", {"validationWorkers": str(self._size)}
            ) from None
        reply: Any = None
        try:
            reply = await asyncio.wait_for(worker.exchange(job), self._timeout_s)
        except TimeoutError:
            raise TimedOut from None
        except (asyncio.IncompleteReadError, OSError):
            raise OutOfMemory from None  # the worker died: what it was asked took more than it has
        finally:
            if reply is not None and reply[0] != "memory":
                idle.put_nowait(worker)
            else:  # timed out, died, ran out of memory, or its caller left mid-job
                self._replace(worker)
        if reply[0] == "ok":
            return [Violation(path, message) for path, message in reply[1]]
        if reply[0] == "memory":
            raise OutOfMemory
        raise SchemaUnusable

    def _replace(self, worker: _Worker) -> None:
        log.warning("validation worker replaced", extra={"pid": worker.process.pid})
        self._all.discard(worker)
        killing = asyncio.ensure_future(worker.kill())
        self._tasks.add(killing)
        killing.add_done_callback(self._tasks.discard)
        if not self._closed:
            self._spawn_soon()

    async def aclose(self) -> None:
        self._closed = True
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        workers, self._all = self._all, set()
        for worker in workers:
            await worker.kill()


def _log_spawn_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a validation worker could not start: %s", type(task.exception()).__name__)
