"""A container health check: `python -m toolmesh.runtime.healthcheck ADDRESS [SERVICE]`.

Asks the standard gRPC health service at ADDRESS about SERVICE (the full
service name, e.g. toolmesh.v1.RegistryService; "" asks about the whole
server), prints the answer and exits 0 when it is SERVING, 1 otherwise. A
server that is draining answers NOT_SERVING, so an orchestrator stops sending
it work before it goes away. It imports only gRPC, so each check starts fast.

A server that serves TLS is checked over TLS with the same environment the
service reads (TOOLMESH_TLS_CERT / _KEY / _CA): a Kubernetes `grpc` probe
cannot speak TLS, so the manifests run this command as an `exec` probe inside
the container. The certificate names a service, not 127.0.0.1: `--server-name`
(env TOOLMESH_TLS_SERVER_NAME) says which name to expect.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

# What `check` answers besides the health service's own statuses.
UNREACHABLE = "UNREACHABLE"
SERVICE_UNKNOWN = "SERVICE_UNKNOWN"
SERVING = health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2.HealthCheckResponse.SERVING)
# The service's own TLS files (toolmesh.core.tls reads the same names; not imported, to start fast).
ENV_CERT, ENV_KEY, ENV_CA = "TOOLMESH_TLS_CERT", "TOOLMESH_TLS_KEY", "TOOLMESH_TLS_CA"
ENV_SERVER_NAME = "TOOLMESH_TLS_SERVER_NAME"


def tls_credentials() -> grpc.ChannelCredentials | None:
    """TLS when the environment gives the service a certificate or a CA; None means plaintext.

    The service's own certificate goes along as the client's: a check of a listener that
    wants mutual TLS passes too.
    """
    cert, key, ca = (os.environ.get(name) for name in (ENV_CERT, ENV_KEY, ENV_CA))
    if not (cert or ca):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes() if ca else None,
        private_key=Path(key).read_bytes() if cert and key else None,
        certificate_chain=Path(cert).read_bytes() if cert and key else None,
    )


def _channel(address: str, server_name: str | None) -> grpc.Channel:
    credentials = tls_credentials()
    if credentials is None:
        return grpc.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def check(address: str, service: str = "", timeout_s: float = 2.0, server_name: str | None = None) -> str:
    """The health of `service` at `address`: SERVING, NOT_SERVING, SERVICE_UNKNOWN, UNREACHABLE, ...

    A server that does not answer within `timeout_s` (or refuses the
    connection) is UNREACHABLE; a name the server does not serve is
    SERVICE_UNKNOWN; any other failed call is named by its status code.
    With TLS in the environment (tls_credentials), the server's certificate
    must name `server_name` (default: the host of `address`).
    """
    with _channel(address, server_name) as channel:
        # The method itself, as health_pb2_grpc.HealthStub makes it: the stub's typing leaves its methods out.
        health_check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            response = health_check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as error:
            code = error.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return UNREACHABLE
            if code == grpc.StatusCode.NOT_FOUND:
                return SERVICE_UNKNOWN
            return code.name
    status: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return status


def main(argv: list[str] | None = None) -> int:
    """Check once; print the status; 0 when SERVING, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="python -m toolmesh.runtime.healthcheck",
        description="Exit 0 when a gRPC server reports a service SERVING, 1 otherwise.",
    )
    parser.add_argument("address", help="host:port of the server")
    parser.add_argument("service", nargs="?", default="", help='full service name (default "": the server)')
    parser.add_argument(
        "--server-name",
        default=os.environ.get(ENV_SERVER_NAME),
        help=f"over TLS: the name the server's certificate must hold (env {ENV_SERVER_NAME}; "
        "default: the address's host)",
    )
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait (default %(default)s)")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("the address is empty")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    try:
        status = check(args.address, args.service, args.timeout, args.server_name)
    except OSError as error:  # a TLS file that cannot be read
        parser.error(f"cannot read a TLS file: {error.strerror} ({error.filename})")
    print(status, flush=True)
    return 0 if status == SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
