"""A validation worker: `python -m toolmesh.invocation.validation_worker ADDRESS_SPACE_BYTES`.

Reads length-prefixed pickled Jobs on stdin, answers each on stdout with
("ok", [(path, message), ...]), ("unusable",) or ("memory",). Its address space
is bounded to ADDRESS_SPACE_BYTES, so a validation that would take more fails
here (MemoryError, or the process dies) instead of in the service.
"""

from __future__ import annotations

import contextlib
import pickle
import resource
import sys
from typing import Any, BinaryIO

from toolmesh.core import jsontext
from toolmesh.core.schemas import compile_schema, violations
from toolmesh.invocation.validation_pool import FRAME, READY, Job


def answer(job: Job) -> tuple[Any, ...]:
    try:
        validator = compile_schema(
            job.schema_json,
            tool=job.tool,
            which=job.which,
            require_object=job.require_object,
            max_bytes=job.max_schema_bytes,
        )
        instance = job.instance if job.instance_json is None else jsontext.parse(job.instance_json)
        found = violations(validator, instance, all_of_them=job.all_of_them)
    except MemoryError:
        return ("memory",)
    except Exception:  # its text may quote the instance: never sent
        return ("unusable",)
    return ("ok", [(violation.path, violation.message) for violation in found])


def serve(jobs: BinaryIO, replies: BinaryIO) -> None:
    replies.write(READY)
    replies.flush()
    while header := jobs.read(FRAME.size):
        (size,) = FRAME.unpack(header)
        job: Job = pickle.loads(jobs.read(size))
        try:
            body = pickle.dumps(answer(job), protocol=pickle.HIGHEST_PROTOCOL)
        except MemoryError:
            body = pickle.dumps(("memory",))
        replies.write(FRAME.pack(len(body)) + body)
        replies.flush()


if __name__ == "__main__":
    limit = int(sys.argv[1])
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    serve(sys.stdin.buffer, sys.stdout.buffer)
