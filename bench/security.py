"""The cost of TLS and tokens: the same no-op call through toolmesh in plaintext without tokens, then
with TLS on every hop (mutual TLS between the services) and a signed token verified on every call.

Certificates come from the tests' Pki (a trustme CA made for the run, the services' identity
included); the token is HS256 from a secret made for the run, as `toolmesh token` mints them.
"""

from __future__ import annotations

import contextlib
import secrets
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.stack import SESSION
from toolmesh.auth.grants import Role
from toolmesh.auth.guard import Listener, admission
from toolmesh.auth.tokens import SharedSecret, Verifier, mint
from toolmesh.core.tls import TlsFiles
from trust_testing import Pki


@dataclass(frozen=True)
class Secured:
    """What the processes and the caller of a secured run need."""

    # For every process: the services' certificate, key and CA, and the secret they verify tokens with.
    env: dict[str, str]
    # For the host process: its token (role host for the bench session).
    host_env: dict[str, str]
    credentials: grpc.ChannelCredentials
    call_token: str
    admin_token: str


@contextlib.contextmanager
def secured(directory: Path) -> Iterator[Secured]:
    # The services' certificate names their service identity (a URI SAN), which their internal
    # listeners require of each other under mutual TLS.
    pki = Pki.make(directory)
    served = pki.files("server")
    cert, key, authority = served.cert, served.key, pki.ca_file
    secret = secrets.token_hex(32).encode()

    def token(role: Role, session: str) -> str:
        return mint(secret, roles=[role], sessions=[session], ttl_s=3600, subject="bench")

    yield Secured(
        env={
            "TOOLMESH_TLS_CERT": str(cert),
            "TOOLMESH_TLS_KEY": str(key),
            "TOOLMESH_TLS_CA": str(authority),
            "TOOLMESH_AUTH_SECRET": secret.decode(),
            # The bench's one caller makes more than the default 500 calls/s of a token's subject on
            # a quiet machine: the quota is still checked on each call, never reached.
            "TOOLMESH_LIMITS": "calls_per_second_per_caller=1000000",
        },
        host_env={"TOOLMESH_TOKEN": token(Role.HOST, SESSION)},
        credentials=TlsFiles(ca=authority).channel_credentials(),
        call_token=token(Role.CALL, SESSION),
        admin_token=token(Role.ADMIN, SESSION),
    )


FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "p50": lambda m: m["latency"]["p50_ms"],
    "p99": lambda m: m["latency"]["p99_ms"],
    "calls_per_s": lambda m: m["throughput"]["calls_per_s"],
    "cpu_per_call": lambda m: m["latency"]["cpu_ms_per_call"]["total"],
}


def summary(rounds: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per way of calling: the median of each figure over the rounds, for plaintext and for TLS+tokens,
    and the ratio of the two in each round (median, lowest, highest)."""
    medians = {
        label: {
            way: {name: statistics.median(figure(m) for m in measured) for name, figure in FIGURES.items()}
            for way, measured in by_way.items()
        }
        for label, by_way in rounds.items()
    }
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for way, plain in rounds["plain"].items():
        protected = rounds["tls+tokens"][way]
        ratios[way] = {}
        for name, figure in FIGURES.items():
            each = [figure(on) / figure(off) for off, on in zip(plain, protected, strict=True)]
            ratios[way][name] = {"median": statistics.median(each), "low": min(each), "high": max(each)}
    return {"rounds": len(rounds["plain"]["toolmesh"]), **medians, "tls+tokens/plain": ratios}


class _Context:
    """What the admission reads of a gRPC call: its metadata."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


class _Request:
    session_id = SESSION


async def token_costs(iterations: int) -> dict[str, float]:
    """In process, no network: a signature check (a token seen for the first time) against the whole
    admission of a call whose token was seen before (metadata, cache, role and session), in µs."""
    secret = secrets.token_hex(32).encode()
    verifier = Verifier(SharedSecret(secret))
    tokens = [mint(secret, roles=[Role.CALL], sessions=[SESSION], ttl_s=3600 + n) for n in range(iterations)]
    started = time.perf_counter()
    for token in tokens:
        await verifier.grant(token)
    first_sight = (time.perf_counter() - started) / iterations
    admit = admission("toolmesh.v1.InvocationService/InvokeTool", Listener.PUBLIC, verifier)
    assert admit is not None
    context = _Context((("user-agent", "grpc-python"), ("authorization", f"Bearer {tokens[0]}")))
    started = time.perf_counter()
    for _ in range(iterations * 10):
        await admit(_Request(), context)
    admitted = (time.perf_counter() - started) / (iterations * 10)
    return {"signature_check_us": first_sight * 1e6, "admission_cached_us": admitted * 1e6}
