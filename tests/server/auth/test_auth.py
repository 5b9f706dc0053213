"""Who may do what, without servers: tokens, grants, the policy table, protected mode, ledger keys."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from jwt.utils import base64url_encode

from toolmesh.auth.command import parse_ttl
from toolmesh.auth.grants import Grant, Role, Sessions
from toolmesh.auth.policy import INTERNAL, PUBLIC
from toolmesh.auth.tokens import KEYS_RECHECK_S, JwksFile, SharedSecret, Verifier, keys_from, mint
from toolmesh.contracts.ledger import Ledger
from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.tls import TlsFiles
from toolmesh.runtime.security import Security, Unprotected, is_loopback
from toolmesh.store.memory import MemoryLedgerStore
from toolmesh.v1 import bridge_pb2, invocation_pb2, registry_pb2
from trust_testing import SECRET, Pki, rsa_jwk

pytestmark = pytest.mark.unit


def verifier(keys: Any = None, clock: Any = time.time) -> Verifier:
    # PyJWT checks exp and nbf against the real clock; the verifier's own clock only ages its cache.
    return Verifier(keys or SharedSecret(SECRET), clock=clock)


def claims(**changes: Any) -> dict[str, Any]:
    base = {
        "iss": "toolmesh",
        "aud": "toolmesh",
        "exp": time.time() + 60,
        "roles": ["call"],
        "sessions": ["s"],
        "sub": "tester",
    }
    return base | changes


def signed(changes: dict[str, Any], key: Any = SECRET, algorithm: str = "HS256", **headers: Any) -> str:
    return jwt.encode(claims(**changes), key, algorithm=algorithm, headers=headers or None)


async def refusal(verifying: Verifier, token: str) -> str:
    with pytest.raises(ToolmeshError) as refused:
        await verifying.grant(token)
    assert refused.value.code is Code.UNAUTHENTICATED
    return refused.value.metadata["reason"]


def test_session_patterns_are_exact_ids_or_prefixes() -> None:
    sessions = Sessions.parse(["demo", "team-*", "a:b"])
    assert "demo" in sessions and "team-42" in sessions and "team-" in sessions and "a:b" in sessions
    assert "demo2" not in sessions and "tea" not in sessions and "a" not in sessions
    assert "anything" in Sessions.parse(["*"])
    for bad in ["", "a b", "a*b", "**", "x" * 129, 7]:
        with pytest.raises(ValueError):
            Sessions.parse([bad])  # type: ignore[list-item]


def test_a_grant_scopes_by_role() -> None:
    grant = Grant("me", frozenset({Role.HOST}), Sessions.parse(["s"]), time.time() + 60)
    assert "s" in grant.scope(Role.HOST)
    assert "s" not in grant.scope(Role.CALL)


async def test_a_minted_token_verifies_into_its_grant() -> None:
    token = mint(SECRET, roles=[Role.CALL], sessions=["demo", "t-*"], ttl_s=60, subject="cli")
    grant = await verifier().grant(token)
    assert grant.subject == "cli" and grant.roles == {Role.CALL}
    assert "demo" in grant.sessions and "t-1" in grant.sessions and "other" not in grant.sessions


async def test_expiry_not_before_issuer_audience_and_signature_are_checked() -> None:
    checking = verifier()
    now = time.time()
    assert await refusal(checking, signed({"exp": now - 31})) == "expired"
    assert (await checking.grant(signed({"exp": now - 29}))).roles == {Role.CALL}  # within the leeway
    assert await refusal(checking, signed({"nbf": now + 31})) == "not_yet_valid"
    assert await refusal(checking, signed({"iss": "someone-else"})) == "wrong_issuer_or_audience"
    assert await refusal(checking, signed({"aud": "another-service"})) == "wrong_issuer_or_audience"
    assert await refusal(checking, signed({}, key=b"another secret that is long enough!!")) == "bad_signature"
    assert await refusal(checking, "not.a.token") == "malformed"
    assert await refusal(checking, "x" * 9000) == "malformed"
    assert await refusal(checking, jwt.encode({"roles": ["call"], "sessions": ["s"]}, SECRET)) == "malformed"


async def test_claims_must_name_known_roles_and_valid_sessions() -> None:
    checking = verifier()
    assert await refusal(checking, signed({"roles": ["root"]})) == "claims"
    assert await refusal(checking, signed({"sessions": ["a b"]})) == "claims"
    assert await refusal(checking, signed({"roles": "call"})) == "claims"


async def test_an_unsigned_or_other_algorithm_token_is_refused() -> None:
    unsigned = jwt.encode(claims(roles=["admin"], sessions=["*"]), "", algorithm="none")
    assert await refusal(verifier(), unsigned) == "malformed"


async def test_a_cached_token_still_expires() -> None:
    later = [0.0]
    checking = verifier(clock=lambda: time.time() + later[0])
    token = signed({"exp": time.time() + 10})
    await checking.grant(token)
    later[0] = 10 + 31
    assert await refusal(checking, token) == "expired"


async def test_jwks_file_keys_verify_and_a_rotated_file_is_read_again(tmp_path: Path) -> None:
    first, first_jwk = rsa_jwk("k1")
    second, second_jwk = rsa_jwk("k2")
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [first_jwk]}))
    checking = verifier(JwksFile(path))
    assert (await checking.grant(signed({}, first, "RS256", kid="k1"))).roles == {Role.CALL}
    assert await refusal(checking, signed({"sub": "x"}, second, "RS256", kid="k2")) == "unknown_key"
    path.write_text(json.dumps({"keys": [first_jwk, second_jwk]}))
    stamp = path.stat().st_mtime_ns + 1_000_000_000  # a later modification time, however coarse the clock
    os.utime(path, ns=(stamp, stamp))
    assert (await checking.grant(signed({"sub": "x"}, second, "RS256", kid="k2"))).subject == "x"


async def test_a_key_removed_from_the_jwks_stops_its_cached_tokens_within_the_recheck(tmp_path: Path) -> None:
    """Finding 10: a token in the verified cache outlived the removal of its key from the JWKS."""
    first, first_jwk = rsa_jwk("k1")
    second, second_jwk = rsa_jwk("k2")
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [first_jwk, second_jwk]}))
    later = [0.0]
    checking = verifier(JwksFile(path), clock=lambda: time.time() + later[0])
    kept, removed = signed({}, first, "RS256", kid="k1"), signed({}, second, "RS256", kid="k2")
    for token in (kept, removed):
        await checking.grant(token)
    path.write_text(json.dumps({"keys": [first_jwk]}))
    stamp = path.stat().st_mtime_ns + 1_000_000_000
    os.utime(path, ns=(stamp, stamp))
    later[0] = KEYS_RECHECK_S + 0.1
    assert await refusal(checking, removed) == "unknown_key"
    assert (await checking.grant(kept)).roles == {Role.CALL}


async def test_a_public_key_used_as_an_hmac_secret_is_refused(tmp_path: Path) -> None:
    """The algorithm comes from the key, never from the token's header."""
    private, jwk = rsa_jwk("k1")
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [jwk]}))
    pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = base64url_encode(json.dumps({"alg": "HS256", "kid": "k1"}).encode())
    body = base64url_encode(json.dumps(claims(roles=["admin"], sessions=["*"])).encode())
    signature = base64url_encode(hmac.new(pem, header + b"." + body, hashlib.sha256).digest())
    forged = b".".join([header, body, signature]).decode()
    assert await refusal(verifier(JwksFile(path)), forged) == "malformed"


def test_keys_come_from_a_secret_or_a_jwks_never_both(tmp_path: Path) -> None:
    assert keys_from(None, None) is None
    assert isinstance(keys_from(SECRET, None), SharedSecret)
    with pytest.raises(ValueError, match="not both"):
        keys_from(SECRET, str(tmp_path / "jwks.json"))
    with pytest.raises(ValueError, match="https"):
        keys_from(None, "http://keys.example/jwks.json")
    with pytest.raises(ValueError, match="32 bytes"):
        SharedSecret(b"short")


def test_every_rpc_is_in_the_policy_and_internal_ones_are_never_public() -> None:
    services = [
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
        invocation_pb2.DESCRIPTOR.services_by_name["InvocationService"],
        bridge_pb2.DESCRIPTOR.services_by_name["BridgeService"],
    ]
    every = {f"{service.full_name}/{method.name}" for service in services for method in service.methods}
    assert set(PUBLIC) | INTERNAL == every
    assert "toolmesh.v1.BridgeService/DispatchToolRequest" not in PUBLIC
    assert "toolmesh.v1.BridgeService/DispatchToolRequests" not in PUBLIC
    assert Role.CALL not in PUBLIC["toolmesh.v1.RegistryService/PutTools"].roles
    assert PUBLIC["toolmesh.v1.BridgeService/OpenHostSession"].roles == {Role.HOST}
    for full_method, rule in PUBLIC.items():
        method = full_method.rsplit("/", 1)[1]
        service = next(s for s in services if full_method.startswith(s.full_name))
        if rule.session_field is not None:
            # A dotted path names a field of a message field (RunTool's call.session_id).
            message = service.methods_by_name[method].input_type
            *outer, last = rule.session_field.split(".")
            for name in outer:
                inner = message.fields_by_name[name].message_type
                assert inner is not None
                message = inner
            assert last in message.fields_by_name


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:7401", True),
        ("127.9.9.9:0", True),
        ("[::1]:7401", True),
        ("localhost:7401", True),
        ("unix:/tmp/toolmesh.sock", True),
        ("0.0.0.0:7401", False),
        ("[::]:7401", False),
        ("10.1.2.3:7401", False),
        ("toolmesh.example:7401", False),
    ],
)
def test_loopback_addresses(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_protected_mode_refuses_unprotected_listeners_off_loopback(tmp_path: Path) -> None:
    pki = Pki.make(tmp_path)
    plain = Security()
    plain.check_public("127.0.0.1:7403")
    with pytest.raises(Unprotected, match="--insecure"):
        plain.check_public("0.0.0.0:7403")
    with pytest.raises(Unprotected, match="mutual TLS"):
        plain.check_internal("0.0.0.0:7413")
    tls_only = Security(TlsFiles(pki.files("server").cert, pki.files("server").key))
    with pytest.raises(Unprotected):
        tls_only.check_public("0.0.0.0:7403")  # TLS without tokens: anyone may still do anything
    with pytest.raises(Unprotected):
        tls_only.check_internal("0.0.0.0:7413")  # TLS without a CA: no client certificates required
    protected = pki.server_security()
    protected.check_public("0.0.0.0:7403")
    protected.check_internal("0.0.0.0:7413")
    Security(insecure=True).check_public("0.0.0.0:7403")


def test_token_lifetimes() -> None:
    assert parse_ttl("90") == 90 and parse_ttl("15m") == 900 and parse_ttl("1h") == 3600
    assert parse_ttl("7d") == 7 * 86400
    for bad in ["", "0", "1w", "-1h", "h"]:
        with pytest.raises(ValueError):
            parse_ttl(bad)


async def test_idempotency_keys_of_sessions_with_colons_do_not_collide() -> None:
    ledger = Ledger(MemoryLedgerStore())
    first = await ledger.claim(ToolCall("a:b", "t", "tool", '{"x":1}'), "tr_1", 1000, idempotency_key="c")
    # Session "a" with key "b:c" would have the same store key if the two were joined with ":".
    other = await ledger.claim(ToolCall("a", "t", "tool", '{"x":2}'), "tr_2", 1000, idempotency_key="b:c")
    assert first.is_new and other.is_new
    assert other.record.tool_request_id == "tr_2" and other.record.session_id == "a"
    again = await ledger.claim(ToolCall("a:b", "t", "tool", '{"x":1}'), "tr_3", 1000, idempotency_key="c")
    assert not again.is_new and again.record.tool_request_id == "tr_1"


def test_tls_files_come_in_pairs() -> None:
    with pytest.raises(ValueError, match="go together"):
        TlsFiles(cert=Path("a.pem"))
