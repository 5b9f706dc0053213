"""The bench's ports for the processes it starts, and restarts on the same port after a kill.

Run as the project does (`python -m pytest`, scripts/test), which puts `bench` on sys.path.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from bench.procs import free_port

pytestmark = pytest.mark.unit


def test_free_port_is_below_the_ephemeral_range_and_free() -> None:
    # An outgoing connection's local end comes from the ephemeral range: a port there could be
    # taken between the probe and the bind, or while a killed process restarts on it.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(10000 <= port < low for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_free_port_passes_over_a_port_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        other = free_port()
        picks = iter([taken, taken, other])
        monkeypatch.setattr("bench.procs.random.randrange", lambda *_: next(picks))
        assert free_port() == other
