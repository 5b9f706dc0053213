"""bench.timeline's instrumented copy and its reading of the marks: no process is started.

Run as the project does (`python -m pytest`, scripts/test), which puts `bench` on sys.path.
"""

from __future__ import annotations

import py_compile
from pathlib import Path

import pytest

from bench.timeline import CALLED, DONE, EDITS, RESULT, WARM, calls_of, instrument, timeline

pytestmark = pytest.mark.unit


def test_every_mark_finds_its_place_in_this_tree_once(tmp_path: Path) -> None:
    env = instrument(tmp_path)
    for name, _, new in EDITS:
        assert new in (tmp_path / name).read_text()
        py_compile.compile(str(tmp_path / name), doraise=True)
    assert env["PYTHONPATH"].split(":")[:2] == [
        str(tmp_path / "clients/python/src"),
        str(tmp_path / "services/src"),
    ]


def test_a_site_that_moved_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.timeline.EDITS", [(EDITS[0][0], "no such line\n", "")])
    with pytest.raises(ValueError, match="found 0 times"):
        instrument(tmp_path)


def lines(*calls: list[tuple[int, str]]) -> list[str]:
    # Written by several processes, so out of order: read sorted by time.
    return sorted((f"{at} {name}\n" for call in calls for at, name in call), reverse=True)


def test_the_steps_are_medians_over_calls_in_the_usual_order() -> None:
    warm_up = [(1, CALLED), (2, "H_handler"), (4, DONE), (5, WARM)]
    usual = ["B_work_rx", "H_handler", "B_work_rx", DONE]
    first = list(zip([10_000, 11_000, 12_000, 15_000, 16_000], [CALLED, *usual], strict=True))
    second = list(zip([20_000, 23_000, 24_000, 25_000, 26_000], [CALLED, *usual], strict=True))
    third = list(zip([30_000, 31_000, 32_000, 33_000, 34_000], [CALLED, *usual], strict=True))
    odd = [(40_000, CALLED), (40_500, "H_handler"), (41_000, DONE)]
    calls = calls_of(iter(lines(warm_up, first, second, third, odd)))
    assert len(calls) == 4  # the warm-up's call is left out
    # The bridge's read after the handler began is the result's, not the start ask's.
    assert [name for _, name in calls[0]] == [CALLED, "B_work_rx", "H_handler", "B_work_rx" + RESULT, DONE]
    result = timeline(calls)
    assert (result.calls, result.typical) == (4, 3)
    assert [step.mark for step in result.steps] == ["B_work_rx", "H_handler", "B_work_rx" + RESULT, DONE]
    assert [step.p50_us for step in result.steps] == [1.0, 1.0, 1.0, 1.0]
    assert [step.p90_us for step in result.steps] == [3.0, 1.0, 3.0, 1.0]
    assert result.total_p50_us == 6.0


def test_no_call_marked_from_start_to_end_is_an_error() -> None:
    with pytest.raises(ValueError, match="no call"):
        timeline(calls_of(iter([f"1 {WARM}\n", f"2 {CALLED}\n"])))
