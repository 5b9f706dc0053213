"""`toolmesh up`: the three services in one process, on the embedded default or a shared Redis.

A command of the `toolmesh` CLI that this distribution plugs in (entry point
group `toolmesh.commands`), so the client distribution never imports servers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from toolmesh.assembly.entrypoint import add_store_arguments
from toolmesh.assembly.system import LocalSystem, start_local_system, start_replicas
from toolmesh.bridge.web import DEFAULT_WEB_PORT, add_web_arguments, web_hosts, web_origins
from toolmesh.client.config import DEFAULT_HOST, DEFAULT_PORTS
from toolmesh.core import scrape
from toolmesh.core.scrape import MetricsEndpoint
from toolmesh.rules import limits
from toolmesh.runtime import security
from toolmesh.runtime.server import CannotListen, serve_until_signalled
from toolmesh.store.backends import MEMORY, describe_store, store_url

EXIT_CONFIG = 2


def add_parser(commands: Any) -> None:
    """Add `up` to the CLI's subcommands."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "up", help="start registry, invocation and bridge locally (in-memory state unless --store)"
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="interface to listen on (default %(default)s)")
    for service, port in DEFAULT_PORTS.items():
        parser.add_argument(
            f"--{service}-port", type=int, default=port, help=f"default {port}; 0 picks a free port"
        )
    parser.add_argument(
        "--web-port",
        type=int,
        default=DEFAULT_WEB_PORT,
        help=f"the bridge's port for pages, Connect and gRPC-Web (default {DEFAULT_WEB_PORT}; 0 picks one)",
    )
    add_web_arguments(parser)
    scrape.add_arguments(parser)
    security.add_arguments(parser)
    limits.add_arguments(parser)
    add_store_arguments(parser)
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas of each service (default 1); more than one needs a shared --store: "
        "the first on the ports given, the others on free ports",
    )
    parser.set_defaults(run=run, metrics_endpoint=metrics_endpoint)


def metrics_endpoint(args: argparse.Namespace) -> MetricsEndpoint | None:
    """The endpoint --metrics-listen asks for, under the services' rule; ValueError when refused."""
    address = scrape.address_of(args.metrics_listen)
    if address is None:
        return None
    protection = security.from_args(args)
    protection.check_metrics(address)
    return MetricsEndpoint.create(address, protection.tls)


def internal_ports(system: LocalSystem) -> str:
    return f"{system.registry_internal_target}, {system.bridge_internal_target}"


def internal_guard(protection: security.Security, *, generated: bool) -> str:
    """What guards the internal listeners, in words (never the token)."""
    credential = protection.service
    if not credential.required:
        return "unguarded (loopback, no tokens)"
    parts = []
    if credential.identity is not None:
        suffix = "<name>" if credential.prefix else ""
        parts.append(f"a client certificate naming {credential.identity}{suffix}")
    if credential.token is not None:
        parts.append("a service token generated for this process" if generated else "the service token")
    return "guarded by " + " and ".join(parts)


async def run(args: argparse.Namespace) -> int:
    """Run the services until SIGTERM or Ctrl-C; returns 0, 1 when a port is taken, 2 for bad settings."""
    url = store_url(args.store)
    if args.replicas < 1 or (args.replicas > 1 and url == MEMORY):
        print("toolmesh up: --replicas above 1 needs a shared --store (redis://...)", file=sys.stderr)
        return EXIT_CONFIG
    metrics: MetricsEndpoint | None = args.metrics
    try:
        metrics_port = None if metrics is None else metrics.start()
    except OSError as error:
        print(f"toolmesh up: cannot serve metrics: {error.strerror}", file=sys.stderr)
        return 1
    try:
        description = describe_store(url)
        configured = security.from_args(args)
        # With tokens and no service token configured, one for this process only.
        protection = configured.with_service_token()
        settings = limits.from_args(args)
        system = await start_local_system(
            host=args.host,
            registry_port=args.registry_port,
            invocation_port=args.invocation_port,
            bridge_port=args.bridge_port,
            web_port=args.web_port,
            web_origins=web_origins(args.web_origins),
            web_hosts=web_hosts(args.web_hosts),
            security=protection,
            store_url=url,
            store_prefix=args.store_prefix,
            limits=settings,
        )
        try:
            replicas = await start_replicas(
                system, args.replicas - 1, url, args.store_prefix, limits=settings
            )
        except BaseException:
            await system.stop(0)
            raise
    except CannotListen as exc:
        print(
            f"toolmesh up: {exc.strerror}; choose other ports with --registry-port, --invocation-port, "
            "--bridge-port and --web-port",
            file=sys.stderr,
        )
        return 1
    except (OSError, ValueError) as error:
        print(f"toolmesh up: {error}", file=sys.stderr)
        return EXIT_CONFIG
    generated = protection.service_token is not configured.service_token
    print(f"toolmesh is up ({description})")
    print(f"  registry    {system.registry_target}")
    print(f"  invocation  {system.invocation_target}")
    print(f"  bridge      {system.bridge_target}")
    print(f"  pages       {system.web_url}  (Connect, gRPC-Web)")
    if metrics is not None:
        scheme = "https" if protection.serves_tls else "http"
        host = metrics.address.rpartition(":")[0]
        print(f"  metrics     {scheme}://{host}:{metrics_port}/metrics  (Prometheus text, for operators)")
    for index in range(0, len(replicas), 3):
        registry, bridge, invocation = replicas[index : index + 3]
        print(f"  replica {index // 3 + 2}:  registry {system.host}:{registry.port}  ", end="")
        print(f"invocation {system.host}:{invocation.port}  bridge {system.host}:{bridge.port}")
    if protection.verifier is not None:
        print("  tokens required (mint one with `toolmesh token`)")
    guard = internal_guard(protection, generated=generated)
    print(f"  internal    {internal_ports(system)}  (services only: {guard})")
    print("Press Ctrl-C to stop.", flush=True)
    # Callers first, as in LocalSystem.stop.
    await serve_until_signalled([*reversed(replicas), *system.servers], grace=2.0)
    print("toolmesh stopped", flush=True)
    return 0
