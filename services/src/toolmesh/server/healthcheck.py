"""A container health check: `python -m toolmesh.server.healthcheck ADDRESS [SERVICE]`.

Asks the standard gRPC health service at ADDRESS about SERVICE (the full
service name, e.g. toolmesh.v1.RegistryService; "" asks about the whole
server), prints the answer and exits 0 when it is SERVING, 1 otherwise. A
server that is draining answers NOT_SERVING, so an orchestrator stops sending
it work before it goes away. It imports only gRPC, so each check starts fast.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2

# What `check` answers besides the health service's own statuses.
UNREACHABLE = "UNREACHABLE"
SERVICE_UNKNOWN = "SERVICE_UNKNOWN"
SERVING = health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2.HealthCheckResponse.SERVING)


def check(address: str, service: str = "", timeout_s: float = 2.0) -> str:
    """The health of `service` at `address`: SERVING, NOT_SERVING, SERVICE_UNKNOWN, UNREACHABLE, ...

    A server that does not answer within `timeout_s` (or refuses the
    connection) is UNREACHABLE; a name the server does not serve is
    SERVICE_UNKNOWN; any other failed call is named by its status code.
    """
    with grpc.insecure_channel(address) as channel:
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
        prog="python -m toolmesh.server.healthcheck",
        description="Exit 0 when a gRPC server reports a service SERVING, 1 otherwise.",
    )
    parser.add_argument("address", help="host:port of the server")
    parser.add_argument("service", nargs="?", default="", help='full service name (default "": the server)')
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait (default %(default)s)")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("the address is empty")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    status = check(args.address, args.service, args.timeout)
    print(status, flush=True)
    return 0 if status == SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
