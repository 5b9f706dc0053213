"""The chaos run's checker (bench/chaos.py) on a made-up history: no process is started.

Run as the project does (`python -m pytest`, scripts/test), which puts the repository, and so
`bench`, on sys.path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.chaos import Attempt, Call, Fault, Late, check, check_again, read_executions

pytestmark = pytest.mark.unit

T0 = 1_000_000.0


def ok(tool_request_id: str, execution: str, at: float) -> Attempt:
    return Attempt(0, at - 0.5, at, "OK", True, tool_request_id, execution)


def executions_file(tmp_path: Path, lines: list[dict[str, object]]) -> Path:
    path = tmp_path / "executions-host0.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"event": "st')  # cut by a kill
    return path


def event(kind: str, key: str, tool_request_id: str, execution: str, at: float) -> dict[str, object]:
    return {
        "event": kind,
        "key": key,
        "toolRequestId": tool_request_id,
        "execution": execution,
        "at": at,
        "leftS": 1.0,
    }


def test_the_checker_counts_each_kind_of_violation_once(tmp_path: Path) -> None:
    path = executions_file(
        tmp_path,
        [
            # fine: one execution, its result answered
            event("start", "fine", "tr_1", "x1", T0),
            event("end", "fine", "tr_1", "x1", T0 + 0.1),
            # twice: a non-idempotent call that ran twice
            event("start", "twice", "tr_2", "x2", T0),
            event("start", "twice", "tr_2", "x2b", T0 + 1),
            # lost: ran to its end in time, the caller got TOOL_TIMEOUT; and its handler started late
            event("start", "late", "tr_3", "x3", T0 + 7),
            event("end", "late", "tr_3", "x3", T0 + 7.1),
            event("start", "lost", "tr_4", "x4", T0),
            event("end", "lost", "tr_4", "x4", T0 + 0.2),
            # lost too, as it ended with both bridge replicas down
            event("start", "stranded", "tr_7", "x7", T0 + 20),
            event("end", "stranded", "tr_7", "x7", T0 + 20.2),
        ],
    )
    calls = [
        Call("fine", "chaos_write", T0, [ok("tr_1", "x1", T0 + 0.2)]),
        Call("twice", "chaos_write", T0, [ok("tr_2", "x2b", T0 + 1.2)]),
        Call("late", "chaos_write", T0, [Attempt(1, T0, T0 + 6, "TOOL_TIMEOUT", True, "tr_3")]),
        Call(
            "lost",
            "chaos_write",
            T0,
            [
                Attempt(0, T0, T0 + 12, "CALLER_DEADLINE_EXCEEDED", False, "tr_4"),
                Attempt(1, T0 + 12, T0 + 14, "TOOL_TIMEOUT", True, "tr_4", owner_lost=True),
            ],
        ),
        # never started, yet answered TOOL_HOST_DISCONNECTED; then an untyped error
        Call("gone", "chaos_write", T0, [Attempt(0, T0, T0 + 1, "TOOL_HOST_DISCONNECTED", True, "tr_5")]),
        Call("odd", "chaos_read", T0, [Attempt(0, T0, T0 + 1, "SOMETHING_ELSE", True, "tr_6")]),
        # REGISTRY_UNAVAILABLE while registry0 was stopped and registry1 up
        Call("reg", "chaos_read", T0, [Attempt(0, T0 + 1, T0 + 1.5, "REGISTRY_UNAVAILABLE", False)]),
        Call(
            "stranded", "chaos_write", T0 + 20, [Attempt(0, T0 + 20, T0 + 27, "TOOL_TIMEOUT", True, "tr_7")]
        ),
        # one attempt answered long past its own deadline
        Call("hung", "chaos_read", T0, [Attempt(0, T0, T0 + 30, "CALLER_DEADLINE_EXCEEDED", False)]),
    ]
    faults = [
        Fault("pause", "registry0", T0, T0 + 2),
        # bridge0 is up again when "lost" ends, not when "stranded" does
        Fault("kill", "bridge0", T0 + 0.1, T0 + 0.15),
        Fault("pause", "bridge0", T0 + 19, T0 + 30),
        Fault("kill", "bridge1", T0 + 0.1, T0 + 25),
    ]
    figures = check(calls, read_executions([path]), faults)["figures"]
    assert figures["duplicates (non-idempotent)"] == 1
    # "lost" and "stranded"; "late" ran past any deadline it can have had
    assert figures["lost outcomes"] == 2
    assert figures["lost outcomes with every bridge down"] == 1  # "stranded"
    assert figures["starts after TOOL_TIMEOUT"] == 1
    assert figures["TOOL_HOST_DISCONNECTED never started"] == 1
    assert figures["untyped errors"] == 1
    assert figures["REGISTRY_UNAVAILABLE one registry down"] == 1
    assert figures["answers past deadline"] == 1
    assert figures["calls ok"] == 2 and figures["calls without an outcome"] == 2


def test_a_result_kept_late_is_not_lost_and_one_of_another_execution_is(tmp_path: Path) -> None:
    path = executions_file(
        tmp_path,
        [
            event("start", "kept", "tr_1", "x1", T0),
            event("end", "kept", "tr_1", "x1", T0 + 0.3),
            event("start", "other", "tr_2", "x2", T0),
            event("end", "other", "tr_2", "x2", T0 + 0.3),
            event("start", "none", "tr_3", "x3", T0),
            event("end", "none", "tr_3", "x3", T0 + 0.3),
        ],
    )

    def timed_out(key: str, tool_request_id: str, late: Late) -> Call:
        answer = Attempt(0, T0, T0 + 5.1, "TOOL_TIMEOUT", True, tool_request_id)
        return Call(key, "chaos_write", T0, [answer], late)

    calls = [
        # answered TOOL_TIMEOUT, and GetInvocation then showed the one execution's result
        timed_out("kept", "tr_1", Late(T0 + 20, "OK", "x1")),
        # a late result that names an execution the hosts never ran is an outcome lost
        timed_out("other", "tr_2", Late(T0 + 20, "OK", "elsewhere")),
        # nothing came in the late window: the result that ended in time is lost
        timed_out("none", "tr_3", Late(T0 + 70)),
    ]
    checked = check(calls, read_executions([path]), [])
    figures = checked["figures"]
    assert figures["outcomes kept late (GetInvocation)"] == 2
    assert figures["lost outcomes"] == 2
    whys = sorted(example["why"] for example in checked["examples"]["lost outcomes"])
    assert whys == ["a late result not of its one execution", "ran to its end in time, answered TOOL_TIMEOUT"]

    # A saved history keeps what the lookups found: checked again, the same figures.
    saved = {
        "settings": {"seconds": 1.0, "seed": 1},
        "history": {
            "calls": [
                {
                    "key": c.key,
                    "tool": c.tool,
                    "started": c.started,
                    "attempts": [vars(a) for a in c.attempts],
                    "late": vars(c.late) if c.late else None,
                }
                for c in calls
            ],
            "executions": [vars(run) for runs in read_executions([path]).values() for run in runs],
        },
        "faults": {"history": []},
    }
    saved_path = tmp_path / "chaos.json"
    saved_path.write_text(json.dumps(saved))
    again = "\n".join(check_again(saved_path))
    assert any(
        line.split()[:2] == ["lost", "outcomes"] and line.split()[-1] == "2" for line in again.splitlines()
    )


def died_and_could(tmp_path: Path) -> Path:
    """Two runs of host0's that ended in 0.3 s: call "died" at T0, call "could" at T0 + 10."""
    return executions_file(
        tmp_path,
        [
            event("start", "died", "tr_1", "x1", T0),
            event("end", "died", "tr_1", "x1", T0 + 0.3),
            event("start", "could", "tr_2", "x2", T0 + 10),
            event("end", "could", "tr_2", "x2", T0 + 10.3),
        ],
    )


def test_a_result_only_its_killed_host_held_is_shown_apart_not_as_lost(tmp_path: Path) -> None:
    # both ended with both bridges frozen; their host was killed 1.7 s later
    path = died_and_could(tmp_path)
    calls = [
        Call(
            "died", "chaos_write", T0, [Attempt(0, T0, T0 + 5.1, "TOOL_TIMEOUT", True, "tr_1")], Late(T0 + 70)
        ),
        Call("could", "chaos_write", T0 + 10, [Attempt(0, T0 + 10, T0 + 15.1, "TOOL_TIMEOUT", True, "tr_2")]),
    ]
    faults = [
        Fault("pause", "bridge0", T0 - 1, T0 + 8),
        Fault("pause", "bridge1", T0 - 1, T0 + 4),
        Fault("kill", "host0", T0 + 2, T0 + 3),
        # "could": bridge1 is up again at +11, before its host is killed at +12
        Fault("pause", "bridge0", T0 + 9, T0 + 20),
        Fault("pause", "bridge1", T0 + 9, T0 + 11),
        Fault("kill", "host0", T0 + 12, T0 + 13),
    ]
    executions = read_executions([path])
    assert {run.host for runs in executions.values() for run in runs} == {"host0"}
    figures = check(calls, executions, faults)["figures"]
    assert figures["results that died with their host"] == 1
    assert figures["lost outcomes"] == 1  # "could"


def test_a_result_whose_host_was_killed_as_it_was_made_is_shown_apart_not_as_lost(tmp_path: Path) -> None:
    """Both bridges up: a host SIGKILLed 0.2 ms after the handler ended had no time to hand the
    result in (`bench.chaos --seed 107`); one killed 50 ms after it had, and lost it."""
    path = died_and_could(tmp_path)
    calls = [
        Call("died", "chaos_write", T0, [Attempt(0, T0, T0 + 0.4, "TOOL_HOST_DISCONNECTED", True, "tr_1")]),
        Call(
            "could",
            "chaos_write",
            T0 + 10,
            [Attempt(0, T0 + 10, T0 + 10.4, "TOOL_HOST_DISCONNECTED", True, "tr_2")],
        ),
    ]
    faults = [
        Fault("kill", "host0", T0 + 0.3002, T0 + 1),
        Fault("kill", "host0", T0 + 10.35, T0 + 11),
    ]
    figures = check(calls, read_executions([path]), faults)["figures"]
    assert figures["results that died with their host"] == 1
    assert figures["lost outcomes"] == 1  # "could"
