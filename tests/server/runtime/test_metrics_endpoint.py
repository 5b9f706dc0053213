"""The metrics endpoint operators scrape (--metrics-listen): a real `toolmesh up` and a real Prometheus.

The dashboard in deploy/ queries only metric names the running services emit, the labels
carry no tenant's data, and off loopback the endpoint needs TLS (or --insecure), where a
CA makes scrapers show a client certificate.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from redis_testing import RedisServer
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh_testing import (
    SUPPORT,
    HostProcess,
    eventually,
    refused_start,
    start_host_process,
    toolmesh_command,
)
from trust_testing import Pki

# Toolmesh up, a host and Prometheus start in the first test's fixtures.
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy/grafana/toolmesh-dashboard.json"
SESSION = "metrics-tenant-7f3a"
TOOLS = [ToolSpec("echo", "", '{"type": "object"}'), ToolSpec("domain_fail", "", '{"type": "object"}')]


@dataclass
class Up:
    process: asyncio.subprocess.Process
    addresses: dict[str, str]
    metrics_url: str
    redis: RedisServer
    host: HostProcess


async def start_up(*args: str) -> tuple[asyncio.subprocess.Process, list[str]]:
    """`toolmesh up` on free ports with `args`: the process and its banner, up to "Press Ctrl-C"."""
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "up",
        *("--registry-port", "0", "--invocation-port", "0", "--bridge-port", "0", "--web-port", "0"),
        *args,
        stdout=asyncio.subprocess.PIPE,
        cwd=SUPPORT,
    )
    assert process.stdout is not None
    banner: list[str] = []
    while not banner or not banner[-1].startswith("Press Ctrl-C"):
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        assert line, f"toolmesh up exited: {banner}"
        banner.append(line)
    return process, banner


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Up]:
    redis = RedisServer(tmp_path_factory.mktemp("metrics-redis"))
    await redis.start()
    process, banner = await start_up("--store", redis.url, "--metrics-listen", "127.0.0.1:0")
    host = None
    try:
        addresses = {words[0]: words[1] for words in (line.split() for line in banner[1:]) if len(words) > 1}
        async with RegistryClient(addresses["registry"]) as registry:
            await registry.put_tools(SESSION, TOOLS)
        host = await start_host_process(
            addresses["bridge"], SESSION, "e2e_handlers:HANDLERS", tmp_path_factory.mktemp("metrics-markers")
        )
        yield Up(process, addresses, addresses["metrics"], redis, host)
    finally:
        if host is not None:
            await host.stop()
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.wait(), 20)
        await redis.stop()


def fetch(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        body: bytes = response.read()
        return body.decode()


async def scrape(url: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """The endpoint's samples by metric family: (sample name, labels, value)."""
    text = await asyncio.to_thread(fetch, url)
    return {
        family.name: [(s.name, s.labels, s.value) for s in family.samples]
        for family in text_string_to_metric_families(text)
    }


async def make_calls(up: Up) -> None:
    """A call of each kind the dashboard shows: a result, a domain error, a replayed retry."""
    async with InvocationClient(up.addresses["invocation"]) as client:
        ok = await client.invoke(SESSION, "echo", {"n": 1}, turn_id="t1")
        assert ok.outcome is not None and ok.outcome.ok
        domain = await client.invoke(SESSION, "domain_fail", {}, turn_id="t1")
        assert domain.outcome is not None and not domain.outcome.ok
        first = await client.invoke(
            SESSION, "echo", {"n": 2}, turn_id="t2", idempotency_key="k-1", confirm_delivery=False
        )
        again = await client.invoke(SESSION, "echo", {"n": 2}, turn_id="t2", idempotency_key="k-1")
        assert again.replayed and again.tool_request_id == first.tool_request_id


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_a_real_prometheus_scrapes_the_calls_counter(up: Up, tmp_path: Path) -> None:
    await make_calls(up)
    target = urllib.parse.urlsplit(up.metrics_url).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                "scrape_configs": [{"job_name": "toolmesh", "static_configs": [{"targets": [target]}]}],
            }
        )
    )
    api = f"127.0.0.1:{free_port()}"
    prometheus = await asyncio.create_subprocess_exec(
        "prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address={api}",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        by_outcome = "sum by (toolmesh_outcome_code) (toolmesh_invocations_total)"
        query = urllib.parse.urlencode({"query": by_outcome})

        async def counted() -> dict[str, float] | None:
            try:
                answer = json.loads(await asyncio.to_thread(fetch, f"http://{api}/api/v1/query?{query}"))
            except (urllib.error.URLError, ConnectionError):
                return None  # not listening yet
            results = answer["data"]["result"]
            found = {r["metric"]["toolmesh_outcome_code"]: float(r["value"][1]) for r in results}
            return found if found.get("OK", 0) >= 2 and found.get("DOMAIN_ERROR", 0) >= 1 else None

        by_code = await eventually(counted, timeout=30, message="Prometheus never had the calls counter")
        assert by_code["OK"] >= 2 and by_code["DOMAIN_ERROR"] >= 1
    finally:
        prometheus.send_signal(signal.SIGKILL)
        await prometheus.wait()


def dashboard_metrics() -> set[str]:
    """Every metric name the dashboard's queries name."""
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert expressions
    names = set()
    for expression in expressions:
        # Metric names: the identifiers outside braces (labels), brackets (ranges) and `by (...)`,
        # but functions (followed by "(") and the aggregation keywords.
        rest = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\bby\s*\([^)]*\)", " ", expression)
        for word in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rest):
            if not rest[word.end() :].lstrip().startswith("("):
                names.add(word.group())
    return names


async def test_the_dashboard_queries_only_metrics_the_services_emit_without_tenant_data(up: Up) -> None:
    await make_calls(up)
    # A store error last: the store goes away for good.
    await up.redis.kill()
    async with RegistryClient(up.addresses["registry"]) as registry:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await registry.put_tools(SESSION, TOOLS)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE

    samples = await scrape(up.metrics_url)
    emitted = {name for family in samples.values() for name, _, _ in family}
    wanted = dashboard_metrics()
    assert wanted, "the dashboard queries no metric"
    assert wanted <= emitted, sorted(wanted - emitted)
    for name in ("toolmesh_invocations_total", "toolmesh_store_errors_total", "toolmesh_bridge_hosts"):
        assert name in wanted, name
    # Operators' data only: no label value names the tenant's session or its tools.
    tenant_values = {SESSION, "echo", "domain_fail", "NO_ACTIVE_SELECTION", "k-1", "t1", "t2"}
    for family in samples.values():
        for _, labels, _ in family:
            assert not tenant_values & set(labels.values()), labels


async def test_off_loopback_the_endpoint_needs_tls_or_insecure() -> None:
    code, stderr = await refused_start("registry", "--metrics-listen", "0.0.0.0:0", env=dict(os.environ))
    assert code == 2
    assert "refusing to serve metrics on 0.0.0.0:0 without TLS" in stderr


async def test_with_a_ca_a_scraper_without_a_client_certificate_is_refused(tmp_path: Path) -> None:
    pki = Pki.make(tmp_path)
    server, client = pki.files("server"), pki.files("client")
    process, banner = await start_up(
        *("--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-ca", str(pki.ca_file)),
        *("--auth-secret", "a test secret that is long enough for HS256"),
        "--metrics-listen",
        "127.0.0.1:0",
    )
    try:
        url = next(line.split()[1] for line in banner if line.split()[:1] == ["metrics"])
        assert url.startswith("https://")
        anonymous = ssl.create_default_context(cafile=str(pki.ca_file))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            await asyncio.to_thread(fetch, url, anonymous)
        scraper = ssl.create_default_context(cafile=str(pki.ca_file))
        assert client.cert is not None and client.key is not None
        scraper.load_cert_chain(client.cert, client.key)
        assert "process_cpu_seconds_total" in await asyncio.to_thread(fetch, url, scraper)
    finally:
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.wait(), 20)
