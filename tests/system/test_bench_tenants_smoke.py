"""`python -m bench.tenants --quick` on this tree alone, so that the command cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolmesh_testing import run_to_end

pytestmark = pytest.mark.integration

ATTACKS = {"inflight", "subject", "mcp", "slow", "badtokens"}


@pytest.mark.timeout(120)
def test_bench_tenants_quick_replays_every_attack(tmp_path: Path) -> None:
    completed = run_to_end(
        "-m", "bench.tenants", "--quick", "--baseline", "none", "--out", str(tmp_path), timeout=110
    )
    assert "targets, this tree" in completed.stdout
    [written] = tmp_path.glob("tenants-quick-*.json")
    results = json.loads(written.read_text())["results"]["this tree"]
    assert set(results) == ATTACKS
    for attack in results.values():
        assert attack["quiet"]["calls"] > 0
        assert attack["during"]["calls"] > 0
        assert "error" not in attack["attacker"]
    # This tree's refusals, each at its bound.
    assert results["inflight"]["attacker"].get("QUOTA_EXCEEDED", 0) > 0
    assert results["subject"]["quiet_extra"]["subject-less token's call"] == "UNAUTHENTICATED"
    assert results["badtokens"]["attacker"].get("AUTH_THROTTLED", 0) > 0
