"""Which bridge replica a host opens its stream on, when it knows several.

A frozen replica (SIGSTOP, a stuck event loop) takes connections and answers
nothing: a host that opens its stream there waits out its first-event wait
while another replica is up, and a result it holds waits with it. So before
opening, the host asks every replica's standard health check at once and
opens on the first that answers (its current one, if that answers within
PREFERRED_S): any answer, a refusal included, comes from a replica that runs.
A replica that refuses connections (restarting) is asked until it answers or
the wait ends: one that comes back meanwhile is where the host goes (a check
that failed at once left a host waiting on a frozen replica 9 s while the
restarted one was up, holding results past their deadline).
Private to toolmesh.host.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import grpc

from toolmesh.core.races import any_true

# grpc.health.v1.Health/Check: an empty HealthCheckRequest is zero bytes (the server's overall
# health), so no generated code is needed for it.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# The current replica's head start: it keeps the host when it answers within it.
PREFERRED_S = 0.5
# A probe that ended so heard nothing from a replica that runs.
_SILENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


async def answers(channel: grpc.aio.Channel, timeout_s: float) -> bool:
    """Whether the replica behind `channel` answers a health check within `timeout_s`.

    One that refuses connections meanwhile is connected to again (the channel's backoff) until it
    answers.
    """
    check: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(HEALTH_CHECK)
    try:
        await check(b"", timeout=timeout_s, wait_for_ready=True)
    except grpc.aio.AioRpcError as error:
        return error.code() not in _SILENT
    except grpc.aio.UsageError:  # the channel was closed: the host is stopping
        return False
    return True


async def any_answers(channels: Sequence[grpc.aio.Channel], timeout_s: float) -> bool:
    """Whether any replica behind `channels` answers a health check within `timeout_s`."""
    return await any_true(answers(channel, timeout_s) for channel in channels)


async def first_answering(
    channels: Sequence[grpc.aio.Channel], preferred: int, timeout_s: float, stop: asyncio.Event
) -> int | None:
    """The index of the replica to open on.

    `preferred` if it answers within PREFERRED_S, else the first of all to answer within
    `timeout_s`; None if none does (or `stop` is set first).
    """
    probes = {
        asyncio.create_task(answers(channel, timeout_s)): index for index, channel in enumerate(channels)
    }
    stopped = asyncio.create_task(stop.wait())
    try:
        first = next(task for task, index in probes.items() if index == preferred)
        with contextlib.suppress(TimeoutError):
            if await asyncio.wait_for(asyncio.shield(first), PREFERRED_S):
                return preferred
        waiting = set(probes) | {stopped}
        while waiting - {stopped}:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if stopped in done:
                return None
            answered = sorted(probes[task] for task in done if task.result())
            if answered:
                return preferred if preferred in answered else answered[0]
        return None
    finally:
        for task in (*probes, stopped):
            task.cancel()
