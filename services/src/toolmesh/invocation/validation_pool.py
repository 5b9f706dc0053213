"""Worker processes that validate JSON against schemas, each job within a time bound.

A validation that could take long must not hold the event loop, which serves
every other session's calls. Such a validation goes to one of a few worker
processes; one that takes longer than its bound has its worker killed
(SIGKILL) and replaced, and only that call is refused. A worker also has its
address space bounded, so a validation that would take gigabytes fails alone.

Workers start on first use, with the "spawn" method (a fork of a process
running gRPC threads is not safe), and are replaced in a thread so the event
loop never waits for a process to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import resource
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from toolmesh.core import jsontext
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.schemas import Violation, compile_schema, violations

log = logging.getLogger("toolmesh.invocation")

_SPAWN = multiprocessing.get_context("spawn")


@dataclass(frozen=True, slots=True)
class Job:
    """What one validation needs: the schema's text and the instance's text (both plain JSON)."""

    schema_json: str
    tool: str
    which: str
    require_object: bool
    instance_json: str
    all_of_them: bool
    max_schema_bytes: int


class TimedOut(Exception):
    """The validation took longer than its bound; its worker was replaced."""


class OutOfMemory(Exception):
    """The validation needed more memory than a worker has; its worker was replaced."""


class SchemaUnusable(Exception):
    """The schema does not compile here (registered under other rules)."""


def _serve(connection: Connection, address_space_bytes: int) -> None:
    """A worker's loop: a Job in, ("ok", violations) | ("unusable",) | ("memory",) out."""
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (address_space_bytes, address_space_bytes))
    while True:
        try:
            job: Job = connection.recv()
        except (EOFError, OSError):
            return
        reply: tuple[Any, ...]
        try:
            validator = compile_schema(
                job.schema_json,
                tool=job.tool,
                which=job.which,
                require_object=job.require_object,
                max_bytes=job.max_schema_bytes,
            )
            found = violations(validator, jsontext.parse(job.instance_json), all_of_them=job.all_of_them)
            reply = ("ok", [(violation.path, violation.message) for violation in found])
        except MemoryError:
            reply = ("memory",)
        except Exception:  # the text of the exception may quote the instance: never sent
            reply = ("unusable",)
        try:
            connection.send(reply)
        except MemoryError:
            connection.send(("memory",))


class _Worker:
    def __init__(self, address_space_bytes: int) -> None:
        self.connection, child = _SPAWN.Pipe()
        self.process: BaseProcess = _SPAWN.Process(
            target=_serve, args=(child, address_space_bytes), daemon=True, name="toolmesh-validation"
        )
        self.process.start()
        child.close()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
            self.process.join(5)
        self.connection.close()


class ValidationPool:
    """`workers` processes validating one job each at a time, each job within `timeout_s`."""

    def __init__(self, workers: int, timeout_s: float, address_space_bytes: int) -> None:
        self._size = workers
        self._timeout_s = timeout_s
        self._address_space = address_space_bytes
        self._idle: asyncio.Queue[_Worker] | None = None
        self._all: set[_Worker] = set()
        self._closed = False

    async def _start(self) -> asyncio.Queue[_Worker]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self._size):
                self._spawn_soon()
        return self._idle

    def _spawn_soon(self) -> None:
        """A new worker joins the idle ones once its process has started (in a thread)."""

        async def spawn() -> None:
            worker = await asyncio.to_thread(_Worker, self._address_space)
            if self._closed:
                worker.kill()
                return
            self._all.add(worker)
            assert self._idle is not None
            self._idle.put_nowait(worker)

        task = asyncio.ensure_future(spawn())
        task.add_done_callback(_log_spawn_failure)

    async def validate(self, job: Job) -> list[Violation]:
        """The violations (as schemas.violations); TimedOut, OutOfMemory or SchemaUnusable.

        Raises ToolmeshError(OVERLOADED) when no worker frees up within the time bound.
        """
        idle = await self._start()
        try:
            worker = await asyncio.wait_for(idle.get(), self._timeout_s)
        except TimeoutError:
            raise ToolmeshError(
                Code.OVERLOADED, "Every validation worker is busy.", {"validationWorkers": str(self._size)}
            ) from None
        reply: Any = None
        try:
            reply = await asyncio.wait_for(self._exchange(worker, job), self._timeout_s)
        except TimeoutError:
            raise TimedOut from None
        except (EOFError, OSError):
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

    async def _exchange(self, worker: _Worker, job: Job) -> Any:
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()
        fd = worker.connection.fileno()

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(fd, ready)
        try:
            worker.connection.send(job)
            await readable
            return worker.connection.recv()
        finally:
            loop.remove_reader(fd)

    def _replace(self, worker: _Worker) -> None:
        log.warning("validation worker replaced", extra={"pid": worker.process.pid})
        self._all.discard(worker)
        worker.kill()
        if not self._closed:
            self._spawn_soon()

    async def aclose(self) -> None:
        self._closed = True
        workers, self._all = self._all, set()
        for worker in workers:
            await asyncio.to_thread(worker.kill)


def _log_spawn_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a validation worker could not start: %s", type(task.exception()).__name__)
