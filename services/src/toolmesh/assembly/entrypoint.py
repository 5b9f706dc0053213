"""Running one service as its own process: `python -m toolmesh.<service>`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable

from toolmesh.client.config import DEFAULT_PORTS
from toolmesh.core import event_loop, otel, scrape
from toolmesh.core.logs import configure_logging
from toolmesh.core.scrape import MetricsEndpoint
from toolmesh.rules import limits
from toolmesh.runtime import security
from toolmesh.runtime.security import Security
from toolmesh.runtime.server import CannotListen, RunningServer, serve_until_signalled
from toolmesh.runtime.web import add_web_arguments
from toolmesh.store.backends import PREFIX_ENV, STORE_ENV, Stores, describe_store, open_stores, store_url

# Internal listeners (registry lookups, bridge dispatch): loopback unless told otherwise.
INTERNAL_PORTS = {"registry": 7411, "bridge": 7413}
INTERNAL_ENV_VARS = {
    "registry": "TOOLMESH_REGISTRY_INTERNAL_ADDR",
    "bridge": "TOOLMESH_BRIDGE_INTERNAL_ADDR",
}
EXIT_CONFIG = 2
# Dependencies the invocation service can reach through several replicas at once.
REPLICAS_HELP = {
    "registry": "; several replicas on one store: a:7411,b:7411 (tried in turn), or one gRPC target "
    "such as dns:///registry:7411 or ipv4:10.0.0.1:7411,10.0.0.2:7411 (round_robin)",
}


def parse_args(
    service: str,
    dependencies: tuple[str, ...] = (),
    extend: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m toolmesh.{service}")
    parser.add_argument(
        "--listen",
        default=f"127.0.0.1:{DEFAULT_PORTS[service]}",
        help="address callers and hosts connect to (default %(default)s; port 0 picks a free one)",
    )
    if service in INTERNAL_PORTS:
        parser.add_argument(
            "--internal-listen",
            default=f"127.0.0.1:{INTERNAL_PORTS[service]}",
            help="address of the internal listener, for other toolmesh services only "
            "(default %(default)s; off loopback it needs mutual TLS)",
        )
    for dependency in dependencies:
        parser.add_argument(
            f"--{dependency}",
            help=f"the {dependency}'s internal listener (env {INTERNAL_ENV_VARS[dependency]}, "
            f"default 127.0.0.1:{INTERNAL_PORTS[dependency]})"
            + (REPLICAS_HELP.get(dependency, "") if service == "invocation" else ""),
        )
    scrape.add_arguments(parser)
    security.add_arguments(parser)
    limits.add_arguments(parser)
    if extend is not None:
        extend(parser)
    add_store_arguments(parser)
    args = parser.parse_args()
    try:
        describe_store(store_url(args.store))
        # Unknown or malformed limits stop the service here, before it serves anything.
        args.limits = limits.from_args(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def add_web_port_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """--web-listen (the port for pages), --web-origins and --web-hosts: the bridge's flags."""
    parser.add_argument(
        "--web-listen",
        default=default,
        help="address of the port for pages, Connect and gRPC-Web (default %(default)s; 'off' serves "
        "none; off loopback it needs TLS and tokens, as --listen)",
    )
    add_web_arguments(parser)


def web_address(args: argparse.Namespace) -> str | None:
    """The --web-listen address, None for 'off'."""
    address: str = args.web_listen
    return None if address == "off" else address


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        help=f"where state is kept: memory (the default) or redis://host:port/db (env {STORE_ENV})",
    )
    parser.add_argument(
        "--store-prefix", help=f'prefix of every Redis key (env {PREFIX_ENV}, default "toolmesh:")'
    )


def stores_of(args: argparse.Namespace) -> Stores:
    """The stores the --store flags (or the environment) name."""
    return open_stores(store_url(args.store), args.store_prefix)


def security_of(args: argparse.Namespace) -> Security:
    """The flags' security, or exit with the reason it cannot be used."""
    try:
        return security.from_args(args)
    except (OSError, ValueError) as error:
        print(f"toolmesh: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def metrics_of(args: argparse.Namespace, protection: Security) -> MetricsEndpoint | None:
    """The metrics endpoint --metrics-listen asks for (None: none), or exit with why it cannot be."""
    try:
        address = scrape.address_of(args.metrics_listen)
        if address is None:
            return None
        protection.check_metrics(address)
    except ValueError as error:  # security.Unprotected too
        print(f"toolmesh: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    return MetricsEndpoint.create(address, protection.tls)


def run(
    service: str, start: Callable[[], Awaitable[RunningServer]], metrics: MetricsEndpoint | None = None
) -> None:
    """Start the service, print its ports (so a parent process can read them), serve until signalled."""
    try:
        factory = event_loop.loop_factory()
    except ValueError as error:
        print(f"toolmesh {service}: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    configure_logging(f"toolmesh-{service}")
    otel.configure(f"toolmesh-{service}", metric_readers=() if metrics is None else (metrics.reader,))

    async def main() -> None:
        try:
            server = await start()
            if metrics is not None:
                print(f"toolmesh {service} serves metrics on port {metrics.start()}", flush=True)
        except CannotListen as exc:
            print(f"toolmesh {service}: {exc.strerror}", file=sys.stderr)
            sys.exit(1)
        except OSError as exc:
            print(f"toolmesh {service}: cannot serve metrics: {exc.strerror}", file=sys.stderr)
            sys.exit(1)
        if server.internal is not None:
            print(f"toolmesh {service} internal listener on port {server.internal.port}", flush=True)
        if server.web_port is not None:
            print(
                f"toolmesh {service} serves pages (Connect, gRPC-Web) on port {server.web_port}", flush=True
            )
        # Last: the line that says the service is ready, once every port is known.
        print(f"toolmesh {service} listening on port {server.port}", flush=True)
        await serve_until_signalled([server])

    try:
        event_loop.run(main(), factory)
    except security.Unprotected as refusal:
        print(f"toolmesh {service}: {refusal}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    finally:
        if metrics is not None:
            metrics.stop()
        otel.shutdown()


def dependency_address(args: argparse.Namespace, service: str) -> str:
    flag: str | None = getattr(args, service)
    return flag or os.environ.get(INTERNAL_ENV_VARS[service]) or f"127.0.0.1:{INTERNAL_PORTS[service]}"
