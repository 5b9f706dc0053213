"""The metrics endpoint an operator scrapes: Prometheus text over HTTP(S), `--metrics-listen host:port`.

OpenTelemetry's Prometheus exporter (the `prometheus` extra, always there for the
servers) reads the same meters that OTLP exports, so a metric has one name
whichever way it leaves. Off unless the flag is given. The endpoint serves every
path of its port, unauthenticated: it carries no tenant data (no session ids,
tool names or tenants' own codes as labels), and whoever may reach the port, an
operator's scraper, may read it. Where the port may listen is the caller's
rule (a service's protected mode; the gateway's explicit --listen).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolmesh.core.tls import TlsFiles

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricReader

ENV_METRICS_LISTEN = "TOOLMESH_METRICS_LISTEN"
# The port OpenTelemetry gives its Prometheus exporter, used in deploy/.
DEFAULT_METRICS_PORT = 9464


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus text for scraping here (env TOOLMESH_METRICS_LISTEN; off by default; "
        f"port 0 picks a free one; {DEFAULT_METRICS_PORT} is the usual one)",
    )


def address_of(flag: str | None) -> str | None:
    """The endpoint's address from the flag or TOOLMESH_METRICS_LISTEN; None: no endpoint."""
    value = flag or os.environ.get(ENV_METRICS_LISTEN) or None
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--metrics-listen takes HOST:PORT, not {value!r}")
    return value


@dataclass
class MetricsEndpoint:
    """The exporter's reader (for the meter provider) and, once started, the HTTP server serving it."""

    address: str
    tls: TlsFiles
    reader: MetricReader
    _registry: Any
    _server: Any = None

    @classmethod
    def create(cls, address: str, tls: TlsFiles | None = None) -> MetricsEndpoint:
        """Its reader, to pass to toolmesh.core.otel.configure before `start`.

        With a certificate, HTTPS with it; with a CA too, scrapers must present a client
        certificate it signed (as on the internal listener).
        """
        # Imported here: the exporter is an optional dependency of the client distribution.
        from opentelemetry.exporter.prometheus import PrometheusMetricReader  # noqa: PLC0415
        from prometheus_client import CollectorRegistry, ProcessCollector  # noqa: PLC0415

        # Our own registry, not the library's global one: only this process's meters and its
        # process_* figures (CPU, memory, open files), which every scraper expects.
        registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=registry)
        return cls(address, tls or TlsFiles(), PrometheusMetricReader(registry=registry), registry)

    def start(self) -> int:
        """Listen (a thread of its own, off the event loop); returns the port."""
        from prometheus_client import start_http_server  # noqa: PLC0415

        host, _, port = self.address.rpartition(":")
        self._server, _ = start_http_server(
            int(port),
            addr=host.strip("[]"),
            registry=self._registry,
            certfile=None if self.tls.cert is None else str(self.tls.cert),
            keyfile=None if self.tls.key is None else str(self.tls.key),
            client_cafile=None if self.tls.cert is None or self.tls.ca is None else str(self.tls.ca),
            client_auth_required=self.tls.cert is not None and self.tls.ca is not None,
        )
        bound: int = self._server.server_port
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
