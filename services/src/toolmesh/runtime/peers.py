"""Services calling each other's internal listeners, and those listeners telling who called.

A service's channels to the others' internal listeners carry its service token
(toolmesh.auth.service) on every call, streams included, and present its
certificate under mutual TLS. The internal listener reads the URIs its peer's
certificate names from the call's auth context.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from cryptography import x509

from toolmesh.auth.service import SERVICE_TOKEN_HEADER
from toolmesh.core.channels import BALANCED_OPTIONS, CHANNEL_OPTIONS

# Opens a channel to an internal listener (the service's TLS and service token included).
Connect = Callable[[str], grpc.aio.Channel]

PEM_CERT_PROPERTY = "x509_pem_cert"


def peer_uris(context: Any) -> tuple[str, ...]:
    """The URI subject alternative names of the client certificate of the call (none without one)."""
    pems = context.auth_context().get(PEM_CERT_PROPERTY) or ()
    return tuple(uri for pem in pems for uri in _uris_of(bytes(pem)))


@functools.lru_cache(maxsize=64)
def _uris_of(pem: bytes) -> tuple[str, ...]:
    try:
        certificate = x509.load_pem_x509_certificate(pem)
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return ()
    return tuple(names.get_values_for_type(x509.UniformResourceIdentifier))


def certificate_uris(pem: bytes) -> tuple[str, ...]:
    """The URI subject alternative names of the first certificate of a PEM chain."""
    return _uris_of(pem)


class _WithToken:
    def __init__(self, token: str) -> None:
        self._entry = (SERVICE_TOKEN_HEADER, token)

    async def _intercept(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        with_token = grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )
        return await continuation(with_token, request)


# One interceptor per kind of call: grpc.aio files each interceptor under one kind only.
class _UnaryUnary(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnary(_WithToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self._intercept(continuation, client_call_details, request_iterator)


class _StreamStream(_WithToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self._intercept(continuation, client_call_details, request_iterator)


def service_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding the service token to the metadata of every call, streams included."""
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def open_peer_channel(
    target: str, credentials: grpc.ChannelCredentials | None, token: str | None, *, balanced: bool = False
) -> grpc.aio.Channel:
    """A channel to another service's internal listener: TLS with `credentials`, and `token` on every call."""
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = (
        None if token is None else service_token_interceptors(token)
    )
    options = CHANNEL_OPTIONS + BALANCED_OPTIONS if balanced else CHANNEL_OPTIONS
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
