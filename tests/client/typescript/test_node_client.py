"""A client in another language on nothing but protos/: Node with @grpc/grpc-js and @grpc/proto-loader
reads the .proto files as they are and makes tool calls against real services and a real host."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from toolmesh.assembly.system import LocalSystem
from toolmesh_testing import SUPPORT, HostProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CLIENT = SUPPORT / "node_client"


@pytest.fixture(scope="module")
def node_client() -> Path:
    """The client's packages, installed from its lock file once (npm ci; idempotent)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("Node 20 and npm are needed (README: The two commands)")
    installed = CLIENT / "node_modules" / "@grpc" / "grpc-js" / "package.json"
    if not installed.exists():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=CLIENT, check=True, timeout=300
        )
    return CLIENT


async def test_a_node_client_calls_a_tool_from_the_protos_alone(
    node_client: Path, system: LocalSystem, e2e_host: HostProcess
) -> None:
    process = await asyncio.create_subprocess_exec(
        "node", "call.mjs", system.registry_target, system.invocation_target, "e2e",
        cwd=node_client, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    steps: dict[str, Any] = {line["step"]: line for line in map(json.loads, out.decode().splitlines())}
    assert int(steps["put"]["response"]["revision"]) >= 1
    ok = steps["ok"]["response"]
    assert ok["tool_request_id"].startswith("tr_") and ok["outcome"]["outcome"] == "result_json"
    assert json.loads(ok["outcome"]["result_json"])["echo"] == {"n": 5}
    invalid = steps["invalid"]["response"]["outcome"]
    assert (
        invalid["error"]["code"] == "TOOL_ARGS_INVALID" and invalid["error"]["kind"] == "ERROR_KIND_RUNTIME"
    )
    # A malformed request fails the RPC: INVALID_ARGUMENT (3), no outcome.
    assert steps["refused"]["error"]["code"] == 3 and "session_id" in steps["refused"]["error"]["details"]
