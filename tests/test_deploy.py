"""The deploy/ files can't run here (no container engine): check that they agree with the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_compose_runs_each_service_module_and_exports_to_the_collector() -> None:
    compose = load("compose/docker-compose.yaml")
    services = compose["services"]
    for name in ("registry", "invocation", "bridge"):
        module = services[name]["command"][0]
        assert module == f"toolmesh.{name}"
        assert importlib.util.find_spec(module) is not None
        endpoint = services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert endpoint == "http://otel-collector:4317"
    invocation = services["invocation"]["command"]
    # The invocation service reaches the others' internal listeners.
    assert invocation[invocation.index("--registry") + 1] == "registry:7411"
    assert invocation[invocation.index("--bridge") + 1] == "bridge:7413"
    for name, port in (("registry", "7411"), ("bridge", "7413")):
        command = services[name]["command"]
        assert command[command.index("--internal-listen") + 1] == f"0.0.0.0:{port}"
    assert {"otel-collector", "jaeger"} <= set(services)


def test_compose_publishes_every_port_on_loopback_only() -> None:
    services = load("compose/docker-compose.yaml")["services"]
    published = [(name, port) for name, service in services.items() for port in service.get("ports", [])]
    assert len(published) >= 5
    for name, port in published:
        host, _, _ = str(port).rpartition(":")[0].rpartition(":")
        assert host == "127.0.0.1", (name, port)
    # Internal listeners are never published.
    assert not [port for _, port in published if str(port).endswith((":7411", ":7413"))]


def test_compose_services_off_loopback_say_insecure_explicitly() -> None:
    """Protected mode refuses 0.0.0.0 without TLS and tokens: the compose file opts out in plain sight."""
    services = load("compose/docker-compose.yaml")["services"]
    for name in ("registry", "invocation", "bridge"):
        command = services[name]["command"]
        assert "--insecure" in command or {"--tls-cert", "--auth-secret"} <= set(command), name


def test_collector_pipelines_use_defined_components() -> None:
    config = load("compose/otel-collector.yaml")
    for pipeline in config["service"]["pipelines"].values():
        assert set(pipeline["receivers"]) <= set(config["receivers"])
        assert set(pipeline.get("processors", [])) <= set(config["processors"])
        assert set(pipeline["exporters"]) <= set(config["exporters"])
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
