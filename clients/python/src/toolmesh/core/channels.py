"""Client channels to toolmesh services, with keepalive and message limits.

Calls on them are traced where they are made (telemetry.client_call).
"""

from __future__ import annotations

import ipaddress

import grpc

from toolmesh.core.limits import MAX_MESSAGE_BYTES, RECONNECT_BACKOFF_FIRST_MS, RECONNECT_BACKOFF_MAX_MS

# Shared by servers and clients: message limits, and keepalive pings so that
# either end of a long-lived stream notices a dead peer even when nothing is sent.
TRANSPORT_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
CHANNEL_OPTIONS = [
    *TRANSPORT_OPTIONS,
    # toolmesh decides what may be retried (the ledger, the host SDK); gRPC's
    # transparent retries would also hold a copy of every request in flight.
    ("grpc.enable_retries", 0),
    # gRPC's own backoff grows to 120 s: after a 30 s outage a channel waited
    # about 16 s more before it tried again, failing every call meanwhile.
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_FIRST_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
]


# A target naming several addresses (`ipv4:a:p,b:p`, `dns:///name:port`) spreads calls over them
# and skips those that fail, instead of using the first only (pick_first).
BALANCED_OPTIONS = [("grpc.lb_policy_name", "round_robin")]


def open_channel(
    target: str, credentials: grpc.ChannelCredentials | None = None, *, balanced: bool = False
) -> grpc.aio.Channel:
    """A channel to `target`: TLS with `credentials`, plaintext without; `balanced`: round_robin."""
    options = CHANNEL_OPTIONS + BALANCED_OPTIONS if balanced else CHANNEL_OPTIONS
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=options)
    return grpc.aio.insecure_channel(target, options=options)


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address, without a port) names this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
