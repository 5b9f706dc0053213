"""The `toolmesh` command's parser: every flag explained, one word for the session, a version."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from importlib.metadata import version

import pytest

from toolmesh.cli.main import build_parser

pytestmark = pytest.mark.unit


def commands(
    parser: argparse.ArgumentParser, path: str = "toolmesh"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser under `parser`, with the command line that reaches it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}")


def test_every_flag_of_every_command_says_what_it_is_for() -> None:
    missing = [
        f"{path} {action.option_strings or action.dest}"
        for path, parser in commands(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and action.help != argparse.SUPPRESS
        and not action.help
    ]
    assert missing == []


def test_every_command_that_names_a_session_calls_it_session_and_still_takes_thread() -> None:
    for path, parser in commands(build_parser()):
        flags = {flag for action in parser._actions for flag in action.option_strings}
        if "--thread-id" in flags or "--session-id" in flags:
            assert {"--session-id", "--thread-id"} <= flags, path
            parsed = [a for a in parser._actions if "--thread-id" in a.option_strings]
            assert parsed[0].dest == "session_id", path


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"toolmesh {version('toolmesh')}"
