"""TOOLMESH_EVENT_LOOP: which event loop a toolmesh process runs on (toolmesh.core.event_loop)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from toolmesh.core import event_loop

pytestmark = pytest.mark.unit


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


async def _on_uvloop() -> bool:
    import uvloop  # noqa: PLC0415 - an optional dependency, as in the module under test

    return isinstance(asyncio.get_running_loop(), uvloop.Loop)


def test_the_standard_loop_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    factory = event_loop.loop_factory()
    assert factory is None
    assert event_loop.run(_loop_module(), factory).startswith("asyncio")


@pytest.mark.parametrize("value", [None, ""])
def test_uvloop_by_default(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(event_loop.ENV, raising=False)
    else:
        monkeypatch.setenv(event_loop.ENV, value)
    factory = event_loop.loop_factory()
    assert factory is not None
    assert event_loop.run(_on_uvloop(), factory)


def test_the_standard_loop_by_default_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.ENV, raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: its import fails
    assert event_loop.loop_factory() is None


def test_uvloop_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "uvloop")
    factory = event_loop.loop_factory()
    assert factory is not None
    assert event_loop.run(_on_uvloop(), factory)


def test_an_unknown_loop_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "trio")
    with pytest.raises(ValueError, match="must be one of asyncio, uvloop"):
        event_loop.loop_factory()


def test_uvloop_missing_is_said_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: its import fails
    with pytest.raises(ValueError, match=r"toolmesh\[uvloop\]"):
        event_loop.loop_factory()
