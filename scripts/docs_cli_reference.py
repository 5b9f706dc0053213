"""MkDocs hook: the CLI reference page, generated from the `toolmesh` argparse parsers.

docs/reference/cli.md holds a marker; at build time it becomes each command's
`--help`, from `toolmesh.cli.main.build_parser` (with the servers' commands,
which plug in through their entry point), so the options are never written twice.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from toolmesh.cli.main import build_parser

MARKER = "<!-- cli-reference -->"


def _commands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """The parser and every sub-command's, depth first, by their full command line."""
    found = [(parser.prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found.extend(_commands(sub))
    return found


def render() -> str:
    """Markdown: a section per command, its help as argparse prints it."""
    # Help text wraps to $COLUMNS: fix it so the page does not depend on the terminal.
    os.environ["COLUMNS"] = "100"
    sections = []
    for prog, parser in _commands(build_parser()):
        level = "#" * min(2 + prog.count(" "), 4)
        sections.append(f"{level} `{prog}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Put the generated reference where the CLI page has its marker."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
