"""The flags every command that talks to the services takes: its token and TLS."""

from __future__ import annotations

import argparse

import grpc

from toolmesh.core.bearer import ENV_TOKEN, token_from_env
from toolmesh.core.tls import ENV_CA, ENV_CERT, ENV_KEY, ENV_TLS, client_credentials


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --token, --tls, --tls-ca, --tls-cert and --tls-key to a command that calls a service."""
    parser.add_argument("--token", help=f"bearer token (env {ENV_TOKEN}, preferred: flags show in ps)")
    parser.add_argument(
        "--tls", action="store_true", help=f"use TLS, trusting the system's CAs (env {ENV_TLS}=1)"
    )
    parser.add_argument("--tls-ca", help=f"PEM CA bundle to trust; implies TLS (env {ENV_CA})")
    parser.add_argument("--tls-cert", help=f"PEM client certificate, for mutual TLS (env {ENV_CERT})")
    parser.add_argument("--tls-key", help=f"its PEM private key (env {ENV_KEY})")


def token(args: argparse.Namespace) -> str | None:
    """The --token flag, else TOOLMESH_TOKEN, else None."""
    return token_from_env(args.token)


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials from the flags and environment, or None for plaintext.

    Raises:
        ValueError: a certificate without its key.
        OSError: a file that cannot be read.
    """
    return client_credentials(args.tls, args.tls_cert, args.tls_key, args.tls_ca)
