"""Render the error tables into the docs' error-code page between their markers.

Two tables: the runtime's (toolmesh.core.errors) and the assistant's turn codes
(toolmesh.assistant.errors). `--check` fails when docs/reference/errors.md's
copies differ from the tables (the tests run it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toolmesh.assistant.errors import TURN_TABLE
from toolmesh.core.errors import ERROR_TABLE

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "errors.md"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render_errors() -> str:
    rows = [
        "| code | gRPC status | retryable | caller's fault | message |",
        "| --- | --- | --- | --- | --- |",
    ]
    for code, spec in ERROR_TABLE.items():
        rows.append(
            f"| `{code.value}` | {spec.status.name} | {_yes(spec.retryable)} | "
            f"{_yes(spec.caller_fault)} | {spec.message} |"
        )
    return "\n".join(rows)


def render_turn_codes() -> str:
    rows = ["| code | retryable | ends turn | message |", "| --- | --- | --- | --- |"]
    for code, spec in TURN_TABLE.items():
        rows.append(f"| `{code.value}` | {_yes(spec.retryable)} | {_yes(spec.ends_turn)} | {spec.message} |")
    return "\n".join(rows)


# Each table's markers in the page, and what goes between them.
TABLES = {"error-table": render_errors, "turn-code-table": render_turn_codes}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def with_tables(text: str) -> str:
    for name, render in TABLES.items():
        start, end = markers(name)
        before, _, rest = text.partition(start)
        _, _, after = rest.partition(end)
        text = f"{before}{start}\n{render()}\n{end}{after}"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = PAGE.read_text()
    missing = [name for name in TABLES if any(marker not in text for marker in markers(name))]
    if missing:
        print(f"{PAGE} lacks the markers of {', '.join(missing)}", file=sys.stderr)
        return 1
    updated = with_tables(text)
    if args.check:
        if updated != text:
            print(
                "docs/reference/errors.md's error tables are stale: "
                "run `python scripts/render_error_table.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    PAGE.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
