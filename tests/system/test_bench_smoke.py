"""The benchmark command on a tiny size, so that it cannot rot. Benchmarks themselves are not tests."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from toolmesh_testing import run_to_end

pytestmark = pytest.mark.integration

TABLE_HEADINGS = [
    "One no-op tool call",
    "Tracing overhead on a no-op toolmesh call",
    "CPU ms per sequential call",
    "Scale:",
    "Join storm:",
    "Argument validation alone",
    "TLS and tokens: plaintext without tokens",
    "State store:",
    "Replicas:",
    "Targets (issues 6, 10 and 11)",
]


# A guard against a hang, not a speed check: every section of the bench runs, and on a loaded
# 2-core machine that took 225 s.
@pytest.mark.timeout(500)
def test_bench_quick_prints_its_table_and_writes_every_section(tmp_path: Path) -> None:
    completed = run_to_end("-m", "bench", "--quick", "--out", str(tmp_path), timeout=480)
    for heading in TABLE_HEADINGS:
        assert heading in completed.stdout
    [written] = tmp_path.glob("bench-quick-*.json")
    results = json.loads(written.read_text())

    systems = {"floor", "floor+lookup", "toolmesh", "toolmesh-stream", "toolmesh-sync"}
    if importlib.util.find_spec("mcp") is not None:
        systems |= {"mcp-stdio", "mcp-http"}
    else:
        assert "mcp" in results["skipped"]
    assert set(results["systems"]) == systems
    for system in results["systems"].values():
        assert system["latency"]["p50_ms"] > 0
        assert system["throughput"]["calls"] > 0
    assert {"toolmesh/floor", "toolmesh-stream/floor"} <= set(results["ratios"])

    for way in ("scale", "scale_unary"):
        scale = results[way]
        assert scale["correct"] == scale["calls"] == scale["held_together"]
        assert set(scale["memory"]) == {"invocation", "bridge", "registry", "host"}
    scale_floor = results["scale_floor"]
    assert scale_floor["correct"] == scale_floor["calls"], scale_floor["failures"]
    assert set(scale_floor["memory"]) == {"front", "back", "host"}
    join = results["join_storm"]
    assert join["answered_ok"] == join["calls"]
    secured = results["security"]
    assert set(secured["tls+tokens"]) == set(secured["plain"]) == {"toolmesh", "toolmesh-stream"}
    assert all(figures["calls_per_s"] > 0 for figures in secured["tls+tokens"].values())
    assert secured["tls+tokens/plain"]["toolmesh"]["p50"]["median"] > 0
    assert secured["signature_check_us"] > secured["admission_cached_us"] > 0
    assert join["handler_executions"] >= 1
    assert len(results["validation"]["rows"]) >= 4
    stored = results["store"]
    for label in ("memory", "redis"):
        assert stored[label]["throughput"]["calls"] > 0
    assert set(stored["redis/memory"]) == {"p50", "p99", "calls_per_s", "cpu_per_call"}
    traced = results["tracing"]
    assert traced["spans_exported"] > 0  # tracing on really exported, off really did not
    assert set(traced["on/off"]) == {"p50", "p99", "calls_per_s", "cpu_per_call"}
    assert results["targets"]


@pytest.mark.timeout(240)
def test_bench_faults_quick_runs_every_scenario(tmp_path: Path) -> None:
    run_to_end("-m", "bench.faults", "--quick", "--baseline", "none", "--out", str(tmp_path))
    [written] = tmp_path.glob("faults-quick-*.json")
    figures = json.loads(written.read_text())["results"]["this tree"]
    assert set(figures) == {"message", "unread", "recovery", "routing"}
    assert figures["message"]["quiet"]["calls"] > 0
    assert figures["unread"]["calls_sent"] > 0
    assert figures["recovery"]["registry_back_to_ok_s"] > 0
    assert len(figures["routing"]["rounds"]) == 2


@pytest.mark.timeout(240)
def test_bench_chaos_quick_checks_a_history_under_faults(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    completed = run_to_end(
        "-m", "bench.chaos", "--quick", "--seed", "1", "--out", str(tmp_path), "--logs", str(logs)
    )
    assert "starts after TOOL_TIMEOUT" in completed.stdout
    # Every service and host kept its output, each start of it marked.
    kept = {path.stem: path.read_text() for path in logs.glob("*.log")}
    kinds = ("registry", "bridge", "invocation", "host")
    assert sorted(kept) == sorted(f"{kind}{n}" for kind in kinds for n in (0, 1))
    assert all(text.startswith(f"--- {name} started, pid ") for name, text in kept.items())
    [written] = tmp_path.glob("chaos-*.json")
    results = json.loads(written.read_text())
    assert results["settings"]["seed"] == 1 and results["faults"]["history"]
    assert results["figures"]["calls chaos_write"] > 0 and results["figures"]["attempts"] > 0


@pytest.mark.timeout(240)
def test_mcp_both_ways_runs_every_way(tmp_path: Path) -> None:
    sizes = ["--calls", "20", "--seconds", "0.5", "--rounds", "1"]
    run_to_end("-m", "bench.mcp_both_ways", *sizes, "--out", str(tmp_path))
    [written] = tmp_path.glob("mcp_both_ways-*.json")
    results = json.loads(written.read_text())
    assert set(results["ratios"]) == {"gateway (stdio)", "gateway (HTTP)", "host --mcp"}
    assert all(figures["calls_per_s"] > 0 for figures in results["figures"].values())


@pytest.mark.timeout(240)
def test_bench_limits_quick_runs_every_scenario(tmp_path: Path) -> None:
    run_to_end("-m", "bench.limits", "--quick", "--baseline", "none", "--out", str(tmp_path))
    [written] = tmp_path.glob("limits-quick-*.json")
    results = json.loads(written.read_text())["results"]
    assert set(results["this tree"]) == {"normal", "hostile", "lists"}
    assert results["this tree"]["normal"]["calls"] > 0
    assert results["this tree"]["hostile"]["registration"].startswith("refused LIMIT_EXCEEDED")
    earlier = results["this tree, schema stored earlier"]["hostile"]
    assert earlier["registration"] == "stored earlier"
    assert any("validation_time_limit" in outcome for outcome in earlier["hostile_calls"])
    assert earlier["during"]["calls"] > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("store", ["memory", "redis"])
def test_bench_timeline_marks_every_hop_of_a_call(tmp_path: Path, store: str) -> None:
    written = tmp_path / "timeline.json"
    sizes = ["--calls", "30", "--warmup", "10", "--store", store]
    completed = run_to_end("-m", "bench.timeline", *sizes, "--json", str(written))
    timeline = json.loads(written.read_text())
    assert timeline["calls"] == 30 and timeline["typical"] > 0
    marks = [step["mark"] for step in timeline["steps"]]
    # The call's way through every process, the start ask's round trip included, in order.
    way = ["I_in", "B_dispatch_rx", "H_stream_rx", "B_work_rx", "rx ExchangeHostWorkResponse", "H_handler"]
    way += ["B_work_rx (result)", "rx DispatchToolRequestsResponse", "I_out", "C_done"]
    assert [mark for mark in marks if mark in way] == way
    # Only a store in Redis marks starts in the ledger (the start fence); memory has none to share.
    assert ("B_mark" in marks) is (store == "redis")
    assert "host: START read" in completed.stdout
