"""Client channels to toolmesh services, with keepalive and message limits.

Calls on them are traced where they are made (telemetry.client_call).
"""

from __future__ import annotations

import grpc

from toolmesh.core.limits import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Notice a dead peer on long-lived streams even when nothing is sent.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # toolmesh decides what may be retried (the ledger, the host SDK); gRPC's
    # transparent retries would also hold a copy of every request in flight.
    ("grpc.enable_retries", 0),
]


def open_channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """A channel to `target`: TLS with `credentials`, plaintext without."""
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
