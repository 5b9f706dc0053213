"""Where a call's samples go (bench/stages.py), on made-up py-spy stacks: no process is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import stages

pytestmark = pytest.mark.unit

LOOP = "_run_once (asyncio/base_events.py:1922);Handle._run (asyncio/events.py:80)"
CLAIM = (
    f"{LOOP};InvocationServicer.InvokeTool (/x/services/src/toolmesh/invocation/servicer.py:98);"
    "Invoker.invoke (/x/services/src/toolmesh/invocation/invoker.py:230);"
    "Ledger.claim (/x/services/src/toolmesh/contracts/ledger.py:330);"
    "dumps (/usr/lib/python3.11/json/__init__.py:231)"
)
WRITE = f"{LOOP};_StreamRequestMixin._write (/v/site-packages/grpc/aio/_call.py:500)"
IDLE = "_run_once (asyncio/base_events.py:1898);EpollSelector.select (/usr/lib/python3.11/selectors.py:468)"


def test_the_innermost_named_frame_decides_and_helpers_count_for_their_caller(tmp_path: Path) -> None:
    profile = tmp_path / "sequential-invocation.txt"
    profile.write_text(f"{CLAIM} 30\n{WRITE} 50\n{LOOP} 20\n{IDLE} 900\n")

    figures = stages.breakdown(tmp_path, "sequential", {"invocation": 2.0})["invocation"]

    assert figures["busy_samples"] == 100  # idle left out
    shares = {stage: numbers["share"] for stage, numbers in figures["stages"].items()}
    assert shares == {
        "dispatch stream to the bridge": 0.5,
        "ledger claim (id, identity, record)": 0.3,  # json.dumps called by the claim
        stages.MACHINERY: 0.2,
    }
    # A share of the process's 2 ms of CPU per call.
    assert figures["stages"]["ledger claim (id, identity, record)"]["us_per_call"] == pytest.approx(600)


def test_a_stream_write_in_the_caller_is_its_invoke_tools_stream() -> None:
    frames = stages.frames_of(WRITE)
    assert stages.stage_of(frames, stages.PROCESS_STAGES["caller"] + stages.COMMON) == "InvokeTools stream"
