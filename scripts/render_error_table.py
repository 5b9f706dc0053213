"""Render the error table (toolmesh.core.errors) into README.md between its markers.

`--check` fails when README.md's copy differs from the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toolmesh.core.errors import ERROR_TABLE

README = Path(__file__).resolve().parent.parent / "README.md"
START = "<!-- error-table:start -->"
END = "<!-- error-table:end -->"


def render() -> str:
    rows = [
        "| code | gRPC status | retryable | ends turn | message |",
        "| --- | --- | --- | --- | --- |",
    ]
    for code, spec in ERROR_TABLE.items():
        rows.append(
            f"| `{code.value}` | {spec.status.name} | {'yes' if spec.retryable else 'no'} | "
            f"{'yes' if spec.ends_turn else 'no'} | {spec.message} |"
        )
    return "\n".join(rows)


def with_table(text: str) -> str:
    before, _, rest = text.partition(START)
    _, _, after = rest.partition(END)
    return f"{before}{START}\n{render()}\n{END}{after}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = README.read_text()
    if START not in text or END not in text:
        print(f"{README} lacks the error-table markers", file=sys.stderr)
        return 1
    updated = with_table(text)
    if args.check:
        if updated != text:
            print(
                "README.md's error table is stale: run `python scripts/render_error_table.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    README.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
