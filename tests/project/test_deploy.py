"""deploy/ can't run here (no container engine, no cluster): validate it offline and against the code.

The Kubernetes manifests are checked against the API schemas of a pinned Kubernetes version
(kubernetes-validate, strict: no unknown fields), then, like the compose file and the image, against
the code: the modules the containers run, their ports, the health service names the servers
register, the environment variables the code reads, and how long a stop takes.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from opentelemetry.sdk import environment_variables as otel_environment_variables

from toolmesh.assembly.entrypoint import INTERNAL_PORTS
from toolmesh.assembly.system import LocalSystem
from toolmesh.client.config import DEFAULT_PORTS
from toolmesh.core.scrape import DEFAULT_METRICS_PORT
from toolmesh.invocation.invoker import Invoker
from toolmesh.runtime.server import serve_until_signalled
from toolmesh.store.durability import Mode
from toolmesh.store.redis_cluster import parse_cluster_url

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# The oldest Kubernetes the manifests support (the preStop `sleep` action is on by default from 1.30).
KUBERNETES_VERSION = "1.30.0"
SERVICES = ("registry", "invocation", "bridge")
# Set by deploy/ for work of issue 10 landing in parallel; each entry goes once the code reads it.
PENDING_ENV: dict[str, str] = {}
# Longest a last telemetry export may take: one export of spans and one of metrics, each
# bounded by OTEL_EXPORTER_OTLP_TIMEOUT (seconds) from the configuration.
EXPORTS_AT_STOP = 2


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# ---- the code's side


def code_env_names() -> set[str]:
    """TOOLMESH_* and OTEL_* names in the code's string constants, and the OTel SDK's own."""
    pattern = re.compile(r"(TOOLMESH|OTEL)_[A-Z0-9_]+")
    names: set[str] = set()
    for tree in (ROOT / "services/src/toolmesh", ROOT / "clients/python/src/toolmesh"):
        for source in tree.rglob("*.py"):
            if "v1" in source.relative_to(tree).parts:
                continue
            for node in ast.walk(ast.parse(source.read_text())):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                    continue
                if pattern.fullmatch(node.value):
                    names.add(node.value)
    names |= {
        value
        for value in vars(otel_environment_variables).values()
        if isinstance(value, str) and value.startswith("OTEL_")
    }
    return names


def stop_budget_s(service: str, export_timeout_s: float) -> float:
    """Longest a service takes from SIGTERM to exit: drain, stop grace, a last export."""
    budget: float = inspect.signature(serve_until_signalled).parameters["grace"].default
    if service == "invocation":
        # Running calls get this long to finish before the server stops (on_shutdown).
        budget += inspect.signature(Invoker.drain).parameters["timeout_s"].default
    return budget + EXPORTS_AT_STOP * export_timeout_s


def duration_s(text: str) -> float:
    """A compose duration such as "10s", "1m30s" or "500ms", in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


# ---- the Kubernetes manifests


def k8s_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for name in load(K8S / "kustomization.yaml")["resources"]:
        for document in yaml.safe_load_all((K8S / name).read_text()):
            yield name, document


def k8s(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for _, doc in k8s_documents() if doc["kind"] == kind}


def workloads() -> dict[str, dict[str, Any]]:
    return {**k8s("Deployment"), **k8s("StatefulSet")}


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def selected(selector: dict[str, str]) -> list[dict[str, Any]]:
    return [w for w in workloads().values() if selects(selector, pod_labels(w))]


def only_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def config() -> dict[str, str]:
    data: dict[str, str] = k8s("ConfigMap")["toolmesh-config"]["data"]
    return data


def k8s_env_set(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every variable a container gets from the manifests, by name (ConfigMap keys included)."""
    env = {item["name"]: item for item in container.get("env", [])}
    for source in container.get("envFrom", []):
        for key, value in k8s("ConfigMap")[source["configMapRef"]["name"]]["data"].items():
            env.setdefault(key, {"name": key, "value": value})
    return env


@pytest.mark.unit
def test_kustomization_lists_every_manifest_once() -> None:
    kustomization = load(K8S / "kustomization.yaml")
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    assert set(listed) == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert kustomization["namespace"] == "toolmesh"


@pytest.mark.unit
def test_every_manifest_is_valid_for_the_pinned_kubernetes() -> None:
    checked = 0
    for name, document in k8s_documents():
        where = f"{name}: {document.get('kind')} {document.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{where}: {error.message} at {list(error.absolute_path)}")
        checked += 1
    assert checked >= 19


@pytest.mark.unit
def test_every_object_is_in_the_namespace() -> None:
    ((namespace, manifest),) = k8s("Namespace").items()
    assert namespace == "toolmesh"
    assert manifest["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for name, document in k8s_documents():
        if document["kind"] != "Namespace":
            assert document["metadata"]["namespace"] == namespace, name


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_each_service_runs_its_module_on_its_port_replicated_with_a_budget(service: str) -> None:
    port = DEFAULT_PORTS[service]
    deployment = k8s("Deployment")[service]
    assert deployment["spec"]["replicas"] >= 2
    container = only_container(deployment)
    module, *args = container["args"]
    assert module == f"toolmesh.{service}"
    assert importlib.util.find_spec(module) is not None
    assert args[args.index("--listen") + 1] == f"0.0.0.0:{port}"
    # Plaintext off loopback: protected mode would refuse it unless said explicitly.
    assert "--insecure" in args
    ports = [port]
    if service in INTERNAL_PORTS:
        ports.append(INTERNAL_PORTS[service])
        assert args[args.index("--internal-listen") + 1] == f"0.0.0.0:{INTERNAL_PORTS[service]}"
    assert [p["containerPort"] for p in container["ports"]] == [*ports, DEFAULT_METRICS_PORT]
    for probe in ("readinessProbe", "livenessProbe"):
        # The kubelet's grpc probe cannot speak TLS: the health check module runs inside the container.
        assert container[probe]["exec"]["command"] == probe_command(service)
        assert container[probe]["timeoutSeconds"] > 2  # the check's own timeout, plus starting Python
    services = [s for s in k8s("Service").values() if selects(s["spec"]["selector"], pod_labels(deployment))]
    assert services
    for found in services:
        for service_port in found["spec"]["ports"]:
            assert service_port["port"] in ports and service_port["appProtocol"] == "kubernetes.io/h2c"
    # The metrics port is scraped by pod (annotations), not through the Service.
    (budget,) = [
        b
        for b in k8s("PodDisruptionBudget").values()
        if selects(b["spec"]["selector"]["matchLabels"], pod_labels(deployment))
    ]
    assert selected(budget["spec"]["selector"]["matchLabels"]) == [deployment]
    assert budget["spec"]["minAvailable"] == 1


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_pods_are_annotated_for_scraping_where_the_service_serves_metrics(service: str) -> None:
    deployment = k8s("Deployment")[service]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    _, *args = only_container(deployment)["args"]
    host, _, port = args[args.index("--metrics-listen") + 1].rpartition(":")
    assert host == "0.0.0.0" and int(port) == DEFAULT_METRICS_PORT
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": port,
        "prometheus.io/path": "/metrics",
    }
    ports = {p["name"]: p["containerPort"] for p in only_container(deployment)["ports"]}
    assert ports["metrics"] == int(port)
    # Where a network policy guards the pod, it lets the scraper in.
    for policy in k8s("NetworkPolicy").values():
        if selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(deployment)):
            rules = policy["spec"]["ingress"]
            assert any("from" not in rule and {"port": "metrics"} in rule["ports"] for rule in rules)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_health_names_probed_are_the_ones_the_servers_serve(system: LocalSystem) -> None:
    """Each probe's service name, asked of the real server it probes, is SERVING."""
    from toolmesh.runtime.healthcheck import SERVING, check  # noqa: PLC0415

    for service in SERVICES:
        target = getattr(system, f"{service}_target")
        probed = only_container(k8s("Deployment")[service])["readinessProbe"]["exec"]["command"][-1]
        assert await asyncio.to_thread(check, target, probed) == SERVING
        # The compose health check, run as compose runs it, against the same server.
        for compose_service in compose_replicas(service):
            command = compose_service["healthcheck"]["test"]
            assert command[:2] == ["CMD", "python"] and command[4] == f"127.0.0.1:{DEFAULT_PORTS[service]}"
            process = await asyncio.create_subprocess_exec(
                sys.executable, *command[2:4], target, *command[5:], stdout=asyncio.subprocess.PIPE
            )
            stdout, _ = await asyncio.wait_for(process.communicate(), 30)
            assert (process.returncode, stdout.decode().strip()) == (0, SERVING)


def probe_command(service: str) -> list[str]:
    """The probe of a service's pods: the health check module, on its own port, expecting its name."""
    return [
        "python",
        "-m",
        "toolmesh.runtime.healthcheck",
        "--server-name",
        service,
        f"127.0.0.1:{DEFAULT_PORTS[service]}",
        f"toolmesh.v1.{service.title()}Service",
    ]


@pytest.mark.integration
async def test_probe_command_passes_against_a_server_that_serves_tls(tmp_path: Path) -> None:
    """The probe, run with the container's TLS environment, is SERVING; without it, it is refused."""
    from toolmesh.assembly.system import start_registry  # noqa: PLC0415
    from toolmesh.runtime.security import Security  # noqa: PLC0415
    from trust_testing import Pki  # noqa: PLC0415

    pki = Pki.make(tmp_path)
    files = pki.issue("registry", "registry")  # as the registry's certificate names it in a cluster
    server = await start_registry(security=Security(files, pki.server_security().verifier))
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLMESH_TLS")}
    tls_env = plain_env | {"TOOLMESH_TLS_CERT": str(files.cert), "TOOLMESH_TLS_KEY": str(files.key)}
    tls_env["TOOLMESH_TLS_CA"] = str(files.ca)
    command = probe_command("registry")
    command[-2] = f"127.0.0.1:{server.port}"
    answers = []
    try:
        for env in (tls_env, plain_env):
            process = await asyncio.create_subprocess_exec(
                sys.executable, *command[1:], stdout=asyncio.subprocess.PIPE, env=env
            )
            stdout, _ = await asyncio.wait_for(process.communicate(), 30)
            answers.append((process.returncode, stdout.decode().strip()))
    finally:
        await server.stop(0)
    assert answers == [(0, "SERVING"), (1, "UNREACHABLE")]


@pytest.mark.unit
def test_pods_are_locked_down_and_sized() -> None:
    image_user = dockerfile_user()
    for name, workload in workloads().items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        if name in SERVICES:
            assert pod["securityContext"]["runAsUser"] == image_user
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"] == {"drop": ["ALL"]}, name
            for bound in ("requests", "limits"):
                assert set(container["resources"][bound]) == {"cpu", "memory"}, name


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_termination_grace_covers_the_pre_stop_and_draining(service: str) -> None:
    pod = k8s("Deployment")[service]["spec"]["template"]["spec"]
    pre_stop: int = only_container(k8s("Deployment")[service])["lifecycle"]["preStop"]["sleep"]["seconds"]
    budget = pre_stop + stop_budget_s(service, float(config()["OTEL_EXPORTER_OTLP_TIMEOUT"]))
    assert pod["terminationGracePeriodSeconds"] >= budget


@pytest.mark.unit
def test_every_variable_the_deployment_sets_is_read_by_the_code() -> None:
    known = code_env_names() | set(PENDING_ENV)
    for name, workload in k8s("Deployment").items():
        if name not in SERVICES:
            continue
        env = k8s_env_set(only_container(workload))
        # A variable that only feeds another one's $(NAME) is for Kubernetes, not the code.
        feeding = {n for item in env.values() for n in re.findall(r"\$\((\w+)\)", item.get("value", ""))}
        assert set(env) - feeding <= known, (name, set(env) - feeding - known)
    for name, service in compose_services().items():
        if name.startswith(SERVICES):
            assert set(service["environment"]) <= known, (name, set(service["environment"]) - known)


@pytest.mark.unit
def test_pending_variables_are_not_read_yet() -> None:
    """Once the code reads one, it leaves PENDING_ENV and the check above covers it for real."""
    assert not set(PENDING_ENV) & code_env_names()


@pytest.mark.unit
def test_configured_addresses_name_services_and_ports() -> None:
    services = k8s("Service")
    data = config()
    # The invocation service and the bridge reach the others' internal listeners.
    for key, service in (
        ("TOOLMESH_REGISTRY_INTERNAL_ADDR", "registry"),
        ("TOOLMESH_BRIDGE_INTERNAL_ADDR", "bridge"),
    ):
        host, port = data[key].rsplit(":", 1)
        assert int(port) == INTERNAL_PORTS[service]
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
        assert selected(services[host]["spec"]["selector"]) == [k8s("Deployment")[service]]
    # The invocation service dials bridge replicas one by one: the headless Service, internal port only.
    bridges = services[data["TOOLMESH_BRIDGE_INTERNAL_ADDR"].split(":")[0]]["spec"]
    assert bridges["clusterIP"] == "None"
    assert [p["port"] for p in bridges["ports"]] == [INTERNAL_PORTS["bridge"]]
    store = urlsplit(data["TOOLMESH_STORE"])
    assert store.scheme == "redis" and store.hostname is not None
    assert [p["port"] for p in services[store.hostname]["spec"]["ports"]] == [store.port]
    assert selected(services[store.hostname]["spec"]["selector"]) == [k8s("StatefulSet")["redis"]]
    otlp = urlsplit(data["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert otlp.hostname is not None
    collector = services[otlp.hostname]
    assert [p["port"] for p in collector["spec"]["ports"]] == [otlp.port]
    collector_config = yaml.safe_load(k8s("ConfigMap")["otel-collector"]["data"]["config.yaml"])
    assert collector_config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(f":{otlp.port}")


@pytest.mark.unit
def test_bridge_pods_advertise_their_own_address() -> None:
    env = k8s_env_set(only_container(k8s("Deployment")["bridge"]))
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # The invocation service dispatches to the replica's internal listener.
    assert env["TOOLMESH_ADVERTISE_ADDR"]["value"] == f"$(POD_IP):{INTERNAL_PORTS['bridge']}"
    # Kubernetes expands $(POD_IP) only from a variable defined before it.
    names = [item["name"] for item in only_container(k8s("Deployment")["bridge"])["env"]]
    assert names.index("POD_IP") < names.index("TOOLMESH_ADVERTISE_ADDR")


@pytest.mark.unit
def test_redis_persists_its_append_only_file_on_a_claimed_volume() -> None:
    redis = k8s("StatefulSet")["redis"]
    args = only_container(redis)["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in only_container(redis)["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == args[args.index("--dir") + 1]


@pytest.mark.unit
def test_references_between_objects_resolve() -> None:
    config_maps = k8s("ConfigMap")
    secrets_referenced = set()
    for name, workload in workloads().items():
        assert selects(workload["spec"]["selector"]["matchLabels"], pod_labels(workload)), name
        pod = workload["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, name
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, name
            for item in container.get("env", []):
                if "secretKeyRef" in item.get("valueFrom", {}):
                    secrets_referenced.add(item["valueFrom"]["secretKeyRef"]["name"])
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes.keys() | claims, name
            port_names = {p["name"] for p in container["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                named = next(iter(container[probe].values()))
                if isinstance(named, dict) and isinstance(named.get("port"), str):
                    assert named["port"] in port_names, name
    # Not shipped (it holds a secret): the kustomization says how to create it.
    assert secrets_referenced == {"toolmesh-auth"}
    assert "secret generic toolmesh-auth" in (K8S / "kustomization.yaml").read_text()
    for name, service in k8s("Service").items():
        (workload,) = selected(service["spec"]["selector"])
        containers = workload["spec"]["template"]["spec"]["containers"]
        port_names = {p["name"] for c in containers for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names, name
    for name, policy in k8s("NetworkPolicy").items():
        assert selected(policy["spec"]["podSelector"]["matchLabels"]), name


def collector_configs() -> list[dict[str, Any]]:
    return [
        load(DEPLOY / "compose/otel-collector.yaml"),
        yaml.safe_load(k8s("ConfigMap")["otel-collector"]["data"]["config.yaml"]),
    ]


@pytest.mark.unit
@pytest.mark.parametrize("index", [0, 1], ids=["compose", "k8s"])
def test_collector_pipelines_use_defined_components(index: int) -> None:
    collector = collector_configs()[index]
    for pipeline in collector["service"]["pipelines"].values():
        assert set(pipeline["receivers"]) <= set(collector["receivers"])
        assert set(pipeline.get("processors", [])) <= set(collector["processors"])
        assert set(pipeline["exporters"]) <= set(collector["exporters"])
    assert set(collector["service"].get("extensions", [])) <= set(collector.get("extensions", {}))
    assert collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")


# ---- compose


def compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = load(DEPLOY / "compose/docker-compose.yaml")["services"]
    return services


def compose_replicas(service: str) -> list[dict[str, Any]]:
    return [s for s in compose_services().values() if s.get("command", [""])[0] == f"toolmesh.{service}"]


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_compose_runs_two_replicas_of_each_service_under_one_name(service: str) -> None:
    replicas = compose_replicas(service)
    assert len(replicas) == 2
    for replica in replicas:
        command = replica["command"]
        assert importlib.util.find_spec(command[0]) is not None
        assert command[command.index("--listen") + 1] == f"0.0.0.0:{DEFAULT_PORTS[service]}"
        assert replica["networks"]["default"]["aliases"] == [service]
        assert replica["depends_on"]["redis"] == {"condition": "service_healthy"}
        assert replica["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert replica["read_only"] is True and replica["cap_drop"] == ["ALL"]
        export_timeout = float(replica["environment"]["OTEL_EXPORTER_OTLP_TIMEOUT"])
        assert duration_s(replica["stop_grace_period"]) >= stop_budget_s(service, export_timeout)
    # Each replica on its own host port.
    assert len({replica["ports"][0] for replica in replicas}) == 2


@pytest.mark.unit
def test_compose_invocation_reaches_the_other_services_by_their_shared_names() -> None:
    for replica in compose_replicas("invocation"):
        command = replica["command"]
        for dependency in ("registry", "bridge"):
            target = command[command.index(f"--{dependency}") + 1]
            assert target == f"{dependency}:{INTERNAL_PORTS[dependency]}"  # the internal listener
            assert len(compose_replicas(dependency)) == 2
        for name, service in compose_services().items():
            if service.get("command", [""])[0] in ("toolmesh.registry", "toolmesh.bridge"):
                assert replica["depends_on"][name] == {"condition": "service_healthy"}


@pytest.mark.unit
def test_compose_bridges_advertise_their_own_names() -> None:
    named = {name: s for name, s in compose_services().items() if s in compose_replicas("bridge")}
    for name, service in named.items():
        assert service["environment"]["TOOLMESH_ADVERTISE_ADDR"] == f"{name}:{INTERNAL_PORTS['bridge']}"
        command = service["command"]
        assert command[command.index("--registry") + 1] == f"registry:{INTERNAL_PORTS['registry']}"


@pytest.mark.unit
def test_compose_publishes_ports_on_loopback_only() -> None:
    published = [port for service in compose_services().values() for port in service.get("ports", [])]
    assert published
    assert all(port.startswith("127.0.0.1:") for port in published), published
    # Internal listeners are never published.
    internal = {str(port) for port in INTERNAL_PORTS.values()}
    assert not [port for port in published if port.rsplit(":", 1)[1] in internal], published


@pytest.mark.unit
@pytest.mark.parametrize("service", SERVICES)
def test_compose_services_off_loopback_say_insecure_explicitly(service: str) -> None:
    """Protected mode refuses 0.0.0.0 without TLS and tokens: the compose file opts out in plain sight."""
    for replica in compose_replicas(service):
        command = replica["command"]
        assert "--insecure" in command
        if service in INTERNAL_PORTS:
            assert command[command.index("--internal-listen") + 1] == f"0.0.0.0:{INTERNAL_PORTS[service]}"


@pytest.mark.unit
@pytest.mark.parametrize("service", sorted(INTERNAL_PORTS))
def test_internal_ports_admit_only_the_services_that_call_them(service: str) -> None:
    """In the cluster, the internal listeners' port only from toolmesh services that use it."""
    callers = {"registry": {"invocation", "bridge"}, "bridge": {"invocation"}}[service]
    (policy,) = [
        p
        for p in k8s("NetworkPolicy").values()
        if selected(p["spec"]["podSelector"]["matchLabels"]) == [k8s("Deployment")[service]]
    ]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if "internal" not in ports:
            # The public port, open to every peer with a token; the scraper's port (no tenant data).
            assert ports == {"grpc", "metrics"}
            continue
        assert ports == {"internal"}
        allowed = set()
        for peer in rule["from"]:
            selector = peer["podSelector"]
            allowed |= {
                name
                for name, workload in k8s("Deployment").items()
                if selects(selector.get("matchLabels", {}), pod_labels(workload))
                and all(
                    pod_labels(workload).get(e["key"]) in e["values"]
                    for e in selector.get("matchExpressions", [])
                )
            }
        assert allowed == callers


@pytest.mark.unit
def test_compose_redis_is_persistent_and_checked() -> None:
    redis = compose_services()["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert redis["volumes"] == ["redis-data:/data"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert {"otel-collector", "jaeger"} <= set(compose_services())


# ---- the image


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) for each instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(maxsplit=1)[0].upper(), line.split(maxsplit=1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def dockerfile_user() -> int:
    (user,) = [args for instruction, args in dockerfile() if instruction == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit(), "numeric, so Kubernetes can check runAsNonRoot"
    return int(uid)


@pytest.mark.unit
def test_image_installs_both_distributions_and_runs_as_a_user() -> None:
    instructions = dockerfile()
    copied = [args.split() for instruction, args in instructions if instruction == "COPY"]
    assert [source for source, _ in copied] == ["clients/python", "services"]
    for source, _ in copied:
        assert (ROOT / source / "pyproject.toml").is_file()
    (install,) = [args for kind, args in instructions if kind == "RUN" and "pip install" in args]
    assert [destination for _, destination in copied] == [w for w in install.split() if w.startswith("./")]
    assert dockerfile_user() > 0
    expose = [args for instruction, args in instructions if instruction == "EXPOSE"]
    ports = [*DEFAULT_PORTS.values(), *INTERNAL_PORTS.values()]
    assert expose == [" ".join(str(port) for port in ports)]
    entrypoint = [json.loads(args) for instruction, args in instructions if instruction == "ENTRYPOINT"]
    assert entrypoint == [["python", "-m"]]
    (command,) = [json.loads(args) for instruction, args in instructions if instruction == "CMD"]
    assert importlib.util.find_spec(command[0]) is not None


@pytest.mark.unit
def test_build_context_leaves_out_local_state() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert {".git", ".venv", "**/node_modules", "**/__pycache__", "bench/results"} <= set(ignored)
    # What the image builds from must not be ignored.
    assert not {"clients", "services", "clients/python", "**/README.md", "*.md"} & set(ignored)


# ---- the Redis Cluster option: the Kubernetes overlay (deploy/k8s/redis-cluster) against the
# pinned Kubernetes' schemas and the base it patches, the compose override
# (deploy/compose/redis-cluster.yaml) against the compose file, both against the store URL's parser

OVERLAY = K8S / "redis-cluster"
COMPOSE_OVERRIDE = K8S.parent / "compose/redis-cluster.yaml"


def documents(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def overlay_objects() -> dict[tuple[str, str], dict[str, Any]]:
    """The overlay's own objects (not its patches), by kind and name."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in documents(OVERLAY / "redis-cluster.yaml")}


def nodes() -> dict[str, Any]:
    return overlay_objects()[("StatefulSet", "redis-cluster")]


def arg(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.unit
def test_the_overlay_is_the_base_with_its_redis_replaced_by_the_cluster() -> None:
    kustomization = load(OVERLAY / "kustomization.yaml")
    assert kustomization["resources"] == ["..", "redis-cluster.yaml"]
    assert kustomization["namespace"] == "toolmesh"
    listed = {patch["path"] for patch in kustomization["patches"]}
    assert listed == {p.name for p in OVERLAY.glob("*.yaml")} - {"kustomization.yaml", "redis-cluster.yaml"}
    deleted = {
        (doc["kind"], doc["metadata"]["name"])
        for doc in documents(OVERLAY / "without-single-redis.yaml")
        if doc.get("$patch") == "delete"
    }
    base_redis = {
        (kind, name)
        for kind in ("StatefulSet", "Service", "NetworkPolicy")
        for name in k8s(kind)
        if name == "redis"
    }
    assert (
        deleted == base_redis == {("StatefulSet", "redis"), ("Service", "redis"), ("NetworkPolicy", "redis")}
    )


@pytest.mark.unit
def test_every_object_of_the_overlay_is_valid_for_the_pinned_kubernetes() -> None:
    objects = overlay_objects()
    assert {kind for kind, _ in objects} == {"StatefulSet", "Service", "Job", "NetworkPolicy"}
    for (kind, name), document in objects.items():
        assert document["metadata"]["namespace"] == "toolmesh"
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{kind} {name}: {error.message} at {list(error.absolute_path)}")


@pytest.mark.unit
def test_six_nodes_in_cluster_mode_keep_their_state_and_announce_stable_names() -> None:
    statefulset = nodes()
    assert statefulset["spec"]["replicas"] == 6
    container = only_container(statefulset)
    args = container["args"]
    assert args[0] == "redis-server" and arg(args, "--cluster-enabled") == "yes"
    data = arg(args, "--dir")
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]} == {claim["metadata"]["name"]: data}
    assert arg(args, "--cluster-config-file").startswith(data + "/") and arg(args, "--appendonly") == "yes"
    # Each node's DNS name: $(POD_NAME) is the pod's, under the headless Service.
    assert arg(args, "--cluster-announce-hostname") == f"$(POD_NAME).{statefulset['spec']['serviceName']}"
    assert arg(args, "--cluster-preferred-endpoint-type") == "hostname"
    (pod_name,) = container["env"]
    assert pod_name == {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    service = overlay_objects()[("Service", statefulset["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert selects(service["spec"]["selector"], statefulset["spec"]["template"]["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"redis": 6379, "cluster-bus": 16379}  # the bus: the client port + 10000
    assert {p["port"] for p in service["spec"]["ports"]} == set(ports.values())


@pytest.mark.unit
def test_the_bootstrap_job_forms_three_primaries_with_a_replica_each_from_every_node() -> None:
    statefulset = nodes()
    job = overlay_objects()[("Job", "redis-cluster-bootstrap")]
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    service = statefulset["spec"]["serviceName"]
    (loop,) = re.findall(r"for i in ([0-9 ]+); do", script)
    assert [int(i) for i in loop.split()] == list(range(statefulset["spec"]["replicas"]))
    assert f'host="redis-cluster-$i.{service}"' in script
    assert "redis-cli --cluster create $nodes --cluster-replicas 1 --cluster-yes" in script
    assert "cluster_state:ok" in script  # formed once: a second run leaves it alone
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"


@pytest.mark.unit
def test_pods_of_the_cluster_are_locked_down() -> None:
    for kind, name in (("StatefulSet", "redis-cluster"), ("Job", "redis-cluster-bootstrap")):
        spec = overlay_objects()[(kind, name)]["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True and context["capabilities"]["drop"] == ["ALL"]
            assert context["allowPrivilegeEscalation"] is False
            assert container["resources"]["limits"]


@pytest.mark.unit
def test_only_the_services_reach_the_nodes_and_the_nodes_reach_each_other() -> None:
    policy = overlay_objects()[("NetworkPolicy", "redis-cluster")]
    statefulset = nodes()
    assert selects(
        policy["spec"]["podSelector"]["matchLabels"], statefulset["spec"]["template"]["metadata"]["labels"]
    )
    admitted: dict[frozenset[str], set[str]] = {}
    for rule in policy["spec"]["ingress"]:
        (peer,) = rule["from"]
        (names,) = [
            e["values"]
            for e in peer["podSelector"]["matchExpressions"]
            if e["key"] == "app.kubernetes.io/name"
        ]
        admitted[frozenset(p["port"] for p in rule["ports"])] = set(names)
    assert admitted == {
        frozenset({"redis"}): set(SERVICES),
        frozenset({"redis", "cluster-bus"}): {"redis-cluster", "redis-cluster-bootstrap"},
    }
    job = overlay_objects()[("Job", "redis-cluster-bootstrap")]
    assert (
        job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "redis-cluster-bootstrap"
    )


@pytest.mark.unit
def test_the_services_store_names_nodes_of_the_cluster_with_durable_claims_on() -> None:
    (patch,) = documents(OVERLAY / "store.yaml")
    assert (patch["kind"], patch["metadata"]["name"]) == ("ConfigMap", "toolmesh-config")
    assert "TOOLMESH_STORE" in k8s("ConfigMap")["toolmesh-config"]["data"]  # the key it replaces
    address = parse_cluster_url(patch["data"]["TOOLMESH_STORE"])
    assert address.durability.mode is Mode.AUTO  # on: every primary has a replica
    statefulset = nodes()
    names = {
        f"redis-cluster-{i}.{statefulset['spec']['serviceName']}"
        for i in range(statefulset["spec"]["replicas"])
    }
    assert address.nodes and all(host in names and port == 6379 for host, port in address.nodes)


@pytest.mark.unit
def test_the_compose_override_runs_the_services_on_a_six_node_cluster() -> None:
    override = load(COMPOSE_OVERRIDE)["services"]
    node_names = sorted(name for name in override if name.startswith("redis-node-"))
    assert len(node_names) == 6
    for name in node_names:
        command = override[name]["command"]
        assert arg(command, "--cluster-enabled") == "yes" and arg(command, "--appendonly") == "yes"
        assert arg(command, "--cluster-announce-hostname") == name
        assert override[name]["volumes"] == [f"{name}:/data"]
        assert override[name]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    init = override["redis-cluster-init"]
    assert init["depends_on"] == {name: {"condition": "service_healthy"} for name in node_names}
    script = init["command"][2]
    assert [f"getent hosts {name} " in script for name in node_names] == [True] * 6
    assert "--cluster-replicas 1" in script
    replicas = [
        name
        for service in SERVICES
        for name, body in load(K8S.parent / "compose/docker-compose.yaml")["services"].items()
        if body in compose_replicas(service)
    ]
    assert len(replicas) == 6
    for name in replicas:
        assert override[name]["depends_on"] == {
            "redis-cluster-init": {"condition": "service_completed_successfully"}
        }
        address = parse_cluster_url(override[name]["environment"]["TOOLMESH_STORE"])
        assert {host for host, _ in address.nodes} <= set(node_names)
    assert set(load(COMPOSE_OVERRIDE)["volumes"]) == set(node_names)
