"""Running a toolmesh gRPC server: health, reflection, limits, who may call what, graceful stop.

A service with internal RPCs (policy.INTERNAL) also gets an internal listener:
a second server on its own port that serves only those, to other toolmesh
services (their service credential checked on every call: toolmesh.auth.service).
The public listener refuses them (WRONG_LISTENER), and the other way round.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from toolmesh.auth.guard import Listener, admission, serves
from toolmesh.core.channels import TRANSPORT_OPTIONS
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.runtime.decoding import decoding
from toolmesh.runtime.instrument import OpenStreams, instrumented
from toolmesh.runtime.peers import peer_uris
from toolmesh.runtime.reflection import enable_reflection
from toolmesh.runtime.security import LOOPBACK, Security

log = logging.getLogger("toolmesh.server")

SERVER_OPTIONS = [
    *TRANSPORT_OPTIONS,
    # Let clients ping this often on idle connections.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # gRPC sets SO_REUSEPORT by default: a second server on a port in use would start, and
    # share its connections with the first without a word. A port in use must be an error.
    ("grpc.so_reuseport", 0),
]


def server_options(limits: Limits) -> list[tuple[str, Any]]:
    """SERVER_OPTIONS with the received message size bounded by the `message_bytes` limit.

    gRPC refuses a larger message from its length prefix, before reading it, with
    RESOURCE_EXHAUSTED (its own status: no ErrorInfo can be attached that early).
    """
    return [
        *(option for option in SERVER_OPTIONS if option[0] != "grpc.max_receive_message_length"),
        ("grpc.max_receive_message_length", limits.message_bytes),
    ]


class CannotListen(OSError):
    """A server could not listen on its address: another process holds the port, or it is not ours."""

    def __init__(self, address: str) -> None:
        super().__init__(
            errno.EADDRINUSE,
            f"cannot listen on {address}: the port is in use (is toolmesh already running?) "
            "or the address is not one of this machine's",
        )
        self.address = address


@dataclass
class Service:
    """One gRPC service to host: its servicer, how to add it, and what to do before stopping."""

    descriptor: ServiceDescriptor
    servicer: object
    # The generated add_XServicer_to_server.
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    on_shutdown: Callable[[], Awaitable[None]] | None = None

    @property
    def full_name(self) -> str:
        return self.descriptor.full_name

    def has(self, listener: Listener) -> bool:
        """Whether any of its RPCs is served on `listener`."""
        return any(serves(f"{self.full_name}/{m.name}", listener) for m in self.descriptor.methods)


@dataclass
class Listening:
    """One gRPC server on one port, with its health service."""

    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    services: Sequence[Service] = field(default_factory=list)
    # Run after the server stopped, e.g. closing the channels it used.
    after_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # The bridge's web port (Connect and gRPC-Web for pages), when it serves one.
    web_port: int | None = None
    streams: OpenStreams = field(default_factory=OpenStreams)
    # The internal listener, for services with internal RPCs.
    internal: Listening | None = None
    # Stopping: its health services say NOT_SERVING (the web port's /healthz too).
    draining: bool = False

    @property
    def internal_port(self) -> int:
        if self.internal is None:
            raise LookupError("this server has no internal listener")
        return self.internal.port

    async def stop(self, grace: float) -> None:
        """Say NOT_SERVING, run each service's shutdown, end the open streams, then stop within `grace`."""
        self.draining = True
        listeners = [self.health] + ([self.internal.health] if self.internal else [])
        for health in listeners:
            await health.enter_graceful_shutdown()
        for service in self.services:
            if service.on_shutdown is not None:
                await service.on_shutdown()
        # Long-lived streams never end by themselves: end them (SHUTTING_DOWN), so that
        # the stop waits only for unary calls, not for the whole grace.
        self.streams.end_all()
        await self.server.stop(grace)
        if self.internal is not None:
            await self.internal.server.stop(grace)
        for step in self.after_stop:
            await step()


async def start_server(
    services: Sequence[Service],
    address: str = "127.0.0.1:0",
    *,
    security: Security = LOOPBACK,
    internal_address: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> RunningServer:
    """Start a server on `address` (port 0 picks a free port) and return it with its port.

    With `internal_address`, services with internal RPCs serve them there. Raises
    security.Unprotected for a listener off loopback without protection (and not --insecure).
    """
    security.check_public(address)
    internal_wanted = internal_address is not None and any(s.has(Listener.INTERNAL) for s in services)
    if internal_wanted:
        assert internal_address is not None
        security.check_internal(internal_address)
        security.check_service()
    # One set of open streams for both listeners: stopping the server ends them all.
    streams = OpenStreams()
    options = server_options(limits)
    public = await _listen(
        services,
        address,
        Listener.PUBLIC,
        security,
        security.public_credentials(),
        streams=streams,
        options=options,
    )
    internal = None
    if internal_wanted:
        assert internal_address is not None
        try:
            internal = await _listen(
                services,
                internal_address,
                Listener.INTERNAL,
                security,
                security.internal_credentials(),
                streams=streams,
                options=options,
            )
        except BaseException:
            await public.server.stop(0)
            raise
    return RunningServer(
        public.server, public.port, public.health, services, internal=internal, streams=streams
    )


async def _listen(
    services: Sequence[Service],
    address: str,
    listener: Listener,
    security: Security,
    credentials: grpc.ServerCredentials | None,
    *,
    streams: OpenStreams,
    options: list[tuple[str, Any]],
) -> Listening:
    server = grpc.aio.server(options=options)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, decoding(server))

    credential = security.service

    def admit(full_method: str) -> Any:
        return admission(full_method, listener, security.verifier, credential, peer_uris)

    for service in services:
        service.add_to_server(
            instrumented(service.servicer, service.descriptor, admit, streams), decoding(server)
        )
    names = [service.full_name for service in services]
    enable_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], decoding(server))
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:
        raise CannotListen(address) from None
    if port == 0:
        raise CannotListen(address)
    await server.start()
    for name in ["", *names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Listening(server, port, health)


async def serve_until_signalled(servers: Sequence[RunningServer], grace: float = 5.0) -> None:
    """Wait for SIGTERM or SIGINT, then stop every server gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    log.info("stopping", extra={"grace_s": grace})
    await asyncio.gather(*(server.stop(grace) for server in servers))
