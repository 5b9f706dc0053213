"""Fuzzing every RPC (bench/fuzz.py): generated messages, JSON and random bytes to every listener.

No crash, no hang, no untyped status (UNKNOWN, INTERNAL, an error without
ErrorInfo), and every service still SERVING afterwards. The services run
in-process on a loop of their own thread; hypothesis drives plain (blocking)
gRPC and Connect clients from the test's thread. A bounded number of examples
per method keeps it well under a minute; `python -m bench.fuzz --minutes N`
runs longer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from fuzzing import METHODS, Prober, Tally, Targets, run_method, serving
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.v1 import bridge_pb2, tool_pb2

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES_PER_METHOD = 25


@pytest.fixture(scope="module")
def targets() -> Iterator[Targets]:
    """The three services, serving from a loop in a thread of their own."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: list[LocalSystem] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        holder.append(loop.run_until_complete(start_local_system(heartbeat_s=0.5)))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="fuzzed-services", daemon=True)
    thread.start()
    assert started.wait(30)
    system = holder[0]
    yield Targets(
        system.registry_target,
        system.registry_internal_target,
        system.invocation_target,
        system.bridge_target,
        system.bridge_internal_target,
        system.web_url,
    )
    asyncio.run_coroutine_threadsafe(system.stop(0.5), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.mark.parametrize(
    "method", METHODS, ids=lambda method: f"{method.containing_service.name}.{method.name}"
)
def test_every_answer_is_typed_and_prompt(targets: Targets, method: object) -> None:
    tally = Tally()
    prober = Prober(targets, tally)
    try:
        run_method(prober, method, EXAMPLES_PER_METHOD)  # type: ignore[arg-type]
    finally:
        prober.close()
    assert tally.inputs >= EXAMPLES_PER_METHOD
    assert tally.untyped == []
    for target in (targets.registry, targets.invocation, targets.bridge):
        assert serving(target)


def test_an_error_quoting_a_huge_id_still_arrives_typed(targets: Targets) -> None:
    """Found by `bench.fuzz`: an id of 20,000 characters quoted back in full made trailers past gRPC's
    metadata limit, and the caller saw RESOURCE_EXHAUSTED without ErrorInfo; quoted values are cut."""
    tally = Tally()
    prober = Prober(targets, tally)
    huge = "x" * 20_000
    request = bridge_pb2.SubmitToolResultRequest(
        host_session_id=huge, tool_request_id="tr_1", outcome=tool_pb2.ToolOutcome(result_json="{}")
    )
    try:
        prober.probe(
            bridge_pb2.DESCRIPTOR.services_by_name["BridgeService"].methods_by_name["SubmitToolResult"],
            request.SerializeToString(),
        )
    finally:
        prober.close()
    assert tally.untyped == []
    assert tally.inputs == 3 and not tally.statuses["OK"]  # public and internal listeners, web port
