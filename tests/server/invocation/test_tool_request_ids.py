"""New tool request ids: a random version-4 UUID behind the session's slot tag, never the same twice."""

from __future__ import annotations

import os
import uuid

import pytest

from toolmesh.invocation.invoker import new_tool_request_id
from toolmesh.store import slots

pytestmark = pytest.mark.unit


def _random_part(tool_request_id: str) -> uuid.UUID:
    return uuid.UUID(hex=tool_request_id.rsplit("_", 1)[1])


def test_an_id_carries_its_sessions_tag_and_a_version_4_uuid() -> None:
    for session in ("alpha", "beta-2", "a:b"):
        tool_request_id = new_tool_request_id(session)
        assert slots.id_tag(tool_request_id) == slots.session_tag(session)
        random_part = _random_part(tool_request_id)
        assert random_part.version == 4 and random_part.variant == uuid.RFC_4122


def test_ids_do_not_repeat_across_many_pools_of_random_bytes() -> None:
    ids = {new_tool_request_id("alpha") for _ in range(20_000)}  # about 80 refills of the pool
    assert len(ids) == 20_000


def test_a_forked_child_mints_other_ids_than_its_parent() -> None:
    new_tool_request_id("alpha")  # the pool holds unused bytes now
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports and exits
        os.write(writing, new_tool_request_id("alpha").encode())
        os._exit(0)
    os.close(writing)
    os.waitpid(child, 0)
    childs = os.read(reading, 100).decode()
    os.close(reading)
    assert childs and childs != new_tool_request_id("alpha")
