"""Server TLS from PEM files, reloaded when they are rotated on disk.

gRPC asks the fetcher before each new connection's handshake; it stats the
files and hands over a new configuration only when one changed, so a rotated
certificate (or CA) takes effect for new connections without a restart.
A half-written rotation (a file that does not load) keeps the current one.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from typing import cast

import grpc

from toolmesh.core.tls import TlsFiles

log = logging.getLogger("toolmesh.server")


def check_files(files: TlsFiles) -> None:
    """Raise ValueError with a clear message when the certificate, key or CA cannot be used."""
    if files.cert is None or files.key is None:
        raise ValueError("serving TLS needs a certificate and its key (--tls-cert and --tls-key)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(files.cert, files.key)
        if files.ca is not None:
            context.load_verify_locations(files.ca)
    except (OSError, ssl.SSLError) as error:
        raise ValueError(f"the TLS files cannot be used: {error}") from None


class _Rotating:
    def __init__(self, files: TlsFiles) -> None:
        self._files = files
        self._stamp = self._stamps()
        self.current = self._load()

    def _stamps(self) -> tuple[int, ...]:
        paths = [self._files.cert, self._files.key, self._files.ca]
        return tuple(path.stat().st_mtime_ns if path is not None else 0 for path in paths)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        files = self._files
        assert files.cert is not None and files.key is not None
        return grpc.ssl_server_certificate_configuration(
            [(files.key.read_bytes(), files.cert.read_bytes())],
            root_certificates=files.ca.read_bytes() if files.ca is not None else None,
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            check_files(self._files)
            configuration = self._load()
        except (OSError, ValueError) as error:
            log.warning("rotated TLS files not loaded; keeping the current ones: %s", type(error).__name__)
            return None
        self._stamp = stamp
        log.info("TLS files reloaded")
        return configuration


def server_credentials(files: TlsFiles, *, require_client_cert: bool) -> grpc.ServerCredentials:
    """TLS with `files`; with `require_client_cert`, clients must present a certificate the CA signed."""
    check_files(files)
    if require_client_cert and files.ca is None:
        raise ValueError("requiring client certificates needs a CA (--tls-ca)")
    rotating = _Rotating(files)
    # None from the fetcher means "no change" (grpc's documentation); its type stub says otherwise.
    fetch = cast(Callable[[], grpc.ServerCertificateConfiguration], rotating.fetch)
    return grpc.dynamic_ssl_server_credentials(
        rotating.current, fetch, require_client_authentication=require_client_cert
    )
