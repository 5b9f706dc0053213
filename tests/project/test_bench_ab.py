"""The A/B mode's arithmetic and table (bench/ab.py), on made-up rounds: no process is started.

Run as the project does (`python -m pytest`, scripts/test), which puts the repository, and so
`bench`, on sys.path.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench import ab

pytestmark = pytest.mark.unit


def _measured(
    p50: float, calls_per_s: float, stream_calls_per_s: float, cpu: float
) -> dict[str, dict[str, Any]]:
    by_process = {"invocation": cpu / 2, "caller": cpu / 2, "total": cpu}
    return {
        "unary/sequential": {"p50_ms": p50, "p99_ms": 2 * p50, "cpu_ms_per_call": by_process},
        "unary/throughput": {"calls_per_s": calls_per_s, "cpu_ms_per_call": {"total": cpu * 0.8}},
        "stream/throughput": {"calls_per_s": stream_calls_per_s, "cpu_ms_per_call": {"total": cpu * 0.6}},
    }


ROUNDS = {
    # The second round ran on a loaded machine: everything took twice as long.
    "floor": [_measured(1.0, 1000, 1000, 1.0), _measured(2.0, 500, 500, 1.0), _measured(1.0, 1000, 1000, 1)],
    "baseline": [_measured(2.0, 500, 800, 2.0), _measured(4.0, 250, 400, 2.0), _measured(2.0, 500, 800, 2.0)],
    # Head is 10% slower in every round, whatever the machine's load did to that round.
    "head": [_measured(2.2, 450, 720, 2.2), _measured(4.4, 225, 360, 2.2), _measured(2.2, 450, 720, 2.2)],
}


def test_ratios_are_each_rounds_own_so_a_loaded_round_cancels_out() -> None:
    summary = ab.summarize(ROUNDS)

    assert summary["rounds"] == 3
    assert summary["medians"]["baseline"]["p50_ms"] == 2.0
    assert summary["medians"]["head"]["stream_calls_per_s"] == 720
    for key in ("p50_ms", "p99_ms", "cpu_ms", "load_cpu_ms", "stream_cpu_ms"):
        spread = summary["head/baseline"][key]
        assert spread["median"] == pytest.approx(1.1)
        assert spread["min"] == pytest.approx(1.1) and spread["max"] == pytest.approx(1.1)
    assert summary["head/baseline"]["calls_per_s"]["median"] == pytest.approx(0.9)
    assert summary["versus_floor"]["baseline"]["unary p50 / floor"]["median"] == pytest.approx(2.0)
    assert summary["versus_floor"]["head"]["stream calls/s / floor"]["median"] == pytest.approx(0.72)
    assert summary["versus_floor"]["head"]["CPU per call / floor"]["median"] == pytest.approx(2.2)
    assert summary["cpu_ms_by_process"]["head"] == pytest.approx(
        {"invocation": 1.1, "caller": 1.1, "total": 2.2}
    )


def test_the_table_names_both_commits_the_load_and_the_ratios() -> None:
    meta = {
        "baseline": "a4261de",
        "head": "abc1234",
        "calls": 500,
        "seconds": 3.0,
        "concurrency": 64,
        "cpus": 2,
        "load_before": "5.00 6.00 7.00",
        "load_after": "5.50 6.00 7.00",
    }
    printed = ab.table({"meta": meta, "summary": ab.summarize(ROUNDS)})

    assert "a4261de (baseline) against abc1234 (head), medians of 3 rounds" in printed
    assert "load average 5.00 6.00 7.00 before, 5.50 6.00 7.00 after" in printed
    unary_p50 = next(line for line in printed.splitlines() if line.strip().startswith("unary p50 ms"))
    assert unary_p50.split()[3:] == ["1.000", "2.000", "2.200", "1.10x", "(1.10-1.10)"]
    assert "stream calls/s / floor" in printed
    assert "invocation" in printed


def test_the_markdown_table_has_a_row_per_figure_and_the_ratios_to_the_floor() -> None:
    meta = {"baseline": "a4261de", "head": "abc1234"}
    printed = ab.markdown({"meta": meta, "summary": ab.summarize(ROUNDS)}).splitlines()

    assert printed[0] == "| | floor | a4261de | abc1234 | head/baseline |"
    assert printed[1] == "| --- | --- | --- | --- | --- |"
    assert "| unary p50 ms | 1.000 | 2.000 | 2.200 | 1.10x (1.10-1.10) |" in printed
    assert "| unary p50 / floor |  | 2.00x (2.00-2.00) | 2.20x (2.20-2.20) |  |" in printed
    assert len(printed) == 2 + len(ab.FIGURES) + len(ab.VERSUS_FLOOR)


def test_without_a_floor_or_baseline_only_the_medians_remain() -> None:
    summary = ab.summarize({"head": ROUNDS["head"]})

    assert "head/baseline" not in summary and "versus_floor" not in summary
    assert summary["medians"]["head"]["p50_ms"] == 2.2


def test_the_standard_loop_side_is_measured_against_head() -> None:
    # The standard loop's side: head's figures, the CPU per call 0.8x in every round.
    standard = [
        _measured(
            m["unary/sequential"]["p50_ms"], 100, 100, m["unary/sequential"]["cpu_ms_per_call"]["total"] * 0.8
        )
        for m in ROUNDS["head"]
    ]
    summary = ab.summarize({**ROUNDS, "head-asyncio": standard})

    assert summary["asyncio/head"]["cpu_ms"]["median"] == pytest.approx(0.8)
    assert summary["asyncio/head"]["p50_ms"]["median"] == pytest.approx(1.0)
    assert "head-asyncio" in summary["versus_floor"]
    meta = {
        "baseline": "a4261de",
        "head": "abc1234",
        "calls": 500,
        "seconds": 3.0,
        "concurrency": 64,
        "cpus": 2,
        "load_before": "5.00 6.00 7.00",
        "load_after": "5.50 6.00 7.00",
    }
    printed = ab.table({"meta": meta, "summary": summary})
    assert "asyncio/head" in printed and "0.80x (0.80-0.80)" in printed
