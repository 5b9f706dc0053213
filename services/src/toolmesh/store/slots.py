"""Which hash slot a key lives in on a Redis Cluster: every key of one session in that session's.

A session's keys (its tool list, its route, its ledger records, identity
pointers, idempotency keys and its lease of calls in flight) carry the hash tag
`{<tag>}`, the tag a short digest of the session id, so that the ledger's
multi-key scripts stay atomic on one node while sessions spread over every
primary. A key found by a tool request id alone finds its slot because the id
carries its session's tag: `tr_<tag>_<random>` (ids minted before had none:
`tr_<random>`, which a single Redis still reads; a cluster refuses to claim them).

On a single Redis nothing is tagged: the key layout is the one it always had.
"""

from __future__ import annotations

import hashlib
import re

# Four hex digits: 65536 tags, spread over the cluster's 16384 slots.
_TAG_DIGITS = 4
_TAGGED_ID = re.compile(rf"tr_([0-9a-f]{{{_TAG_DIGITS}}})_[0-9A-Za-z]+")

# Generic-store keys that end in a session id (registry tools, bridge routes).
SESSION_KEYS = ("registry:tools:", "bridge:route:")
# Generic-store keys that end in a tool request id (an invocation's latest progress report).
REQUEST_KEYS = ("invocation:progress:",)


def session_tag(session_id: str) -> str:
    """The slot tag of a session: the first hex digits of its SHA-1."""
    return hashlib.sha1(session_id.encode()).hexdigest()[:_TAG_DIGITS]


def tool_request_id(session_id: str, random_part: str) -> str:
    """A tool request id that names its session's slot."""
    return f"tr_{session_tag(session_id)}_{random_part}"


def id_tag(tool_request_id: str) -> str | None:
    """The slot tag a tool request id carries; None for an id minted before ids carried one."""
    found = _TAGGED_ID.fullmatch(tool_request_id)
    return found.group(1) if found else None


def hash_tag(tag: str) -> str:
    return "{" + tag + "}"


def tagged_key(key: str) -> str:
    """A generic-store key in its session's slot when it names a session, or a tool request id that
    carries its session's tag; else unchanged."""
    for kind in SESSION_KEYS:
        if key.startswith(kind):
            session = key[len(kind) :]
            return kind + hash_tag(session_tag(session)) + session
    for kind in REQUEST_KEYS:
        if key.startswith(kind):
            tag = id_tag(key[len(kind) :])
            return key if tag is None else kind + hash_tag(tag) + key[len(kind) :]
    return key
