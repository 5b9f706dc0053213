"""What each part pulls in: the client installs and runs without the servers or their dependencies,
and the error table and the services' domain load without gRPC."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import venv
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What only the servers (or an extra) need: never part of a plain client install.
SERVER_ONLY = {
    "toolmesh-server",
    "grpcio-health-checking",
    "grpcio-reflection",
    "jsonschema-rs",
    "redis",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-exporter-prometheus",
    "prometheus-client",
    "httpx",
    "mcp",
}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _closure(root: str) -> set[str]:
    """Every distribution `root` pulls in without extras, from the installed metadata."""
    seen: set[str] = set()
    pending = [root]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        pending += [_name(r) for r in requires if "extra ==" not in r]
    return seen


@pytest.mark.unit
def test_the_client_distribution_requires_nothing_of_the_servers() -> None:
    closure = _closure("toolmesh")
    assert "grpcio" in closure
    assert not closure & SERVER_ONLY


@pytest.mark.unit
def test_the_server_distribution_depends_on_the_client() -> None:
    assert "toolmesh" in _closure("toolmesh-server")


@pytest.mark.integration
def test_importing_the_host_sdk_and_client_loads_no_server_code() -> None:
    probe = (
        "import sys, toolmesh.host, toolmesh.client, toolmesh.cli.main;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('opentelemetry', 'jsonschema_rs',"
        " 'grpc_health', 'grpc_reflection', 'httpx', 'redis', 'toolmesh')))"
    )
    loaded = json.loads(
        subprocess.run(
            [sys.executable, "-c", probe], check=True, capture_output=True, text=True
        ).stdout.replace("'", '"')
    )
    server_packages = (
        "runtime",
        "rules",
        "contracts",
        "assembly",
        "store",
        "registry",
        "invocation",
        "bridge",
    )
    assert not [m for m in loaded if m.startswith(tuple(f"toolmesh.{p}" for p in server_packages))]
    assert not [m for m in loaded if m.startswith(("opentelemetry.sdk", "jsonschema_rs", "grpc_health.v1"))]
    assert not [m for m in loaded if m.startswith(("httpx", "redis"))]


@pytest.mark.integration
@pytest.mark.parametrize(
    "modules",
    [
        ["toolmesh.core.errors", "toolmesh.contracts.ledger"],
        # The services' domain modules: the transport and the telemetry sit behind their seams.
        [
            "toolmesh.invocation.invoker",
            "toolmesh.invocation.catalog_cache",
            "toolmesh.bridge.router",
            "toolmesh.registry.registry",
        ],
    ],
)
def test_the_error_table_and_the_domain_load_without_grpc(modules: list[str]) -> None:
    probe = (
        f"import sys, {', '.join(modules)}\n"
        "prefixes = ('grpc', 'opentelemetry')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(prefixes)}))"
    )
    result = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pip_install_of_the_client_alone_installs_and_runs_without_the_servers(tmp_path: Path) -> None:
    """A real `pip install clients/python` into an empty virtual environment."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(ROOT / "clients/python"),
        ],
        check=True,
        capture_output=True,
    )
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    installed = {_name(entry["name"]) for entry in json.loads(listed)}
    assert "toolmesh" in installed
    assert not installed & SERVER_ONLY, installed & SERVER_ONLY
    subprocess.run(
        [python, "-c", "import toolmesh.host, toolmesh.client, toolmesh.v1.bridge_pb2_grpc"], check=True
    )
    up = subprocess.run(
        [env_dir / "bin" / "toolmesh", "up"], check=False, capture_output=True, text=True, timeout=60
    )
    assert up.returncode == 2
    assert "toolmesh-server" in up.stderr
