"""The deploy/ files can't run here (no container engine): check that they agree with the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

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
    assert invocation[invocation.index("--registry") + 1] == "registry:7401"
    assert invocation[invocation.index("--bridge") + 1] == "bridge:7403"
    assert {"otel-collector", "jaeger"} <= set(services)


def test_collector_pipelines_use_defined_components() -> None:
    config = load("compose/otel-collector.yaml")
    for pipeline in config["service"]["pipelines"].values():
        assert set(pipeline["receivers"]) <= set(config["receivers"])
        assert set(pipeline.get("processors", [])) <= set(config["processors"])
        assert set(pipeline["exporters"]) <= set(config["exporters"])
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
