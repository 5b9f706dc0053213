"""Summarise py-spy's collapsed stacks (`--format raw`): where each process spends its samples.

`python -m bench.profile_summary DIR [--top N]` prints, for each file in DIR, the
functions with the most samples on the stack (inclusive) and at its top (self).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def summarise(path: Path, top: int) -> str:
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_short(frame) for frame in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] += count
        own[frames[-1]] += count
    lines = [f"== {path.name}: {total} samples"]
    if total == 0:
        return lines[0]
    lines.append("  inclusive:")
    lines += [f"    {count / total:6.1%}  {frame}" for frame, count in inclusive.most_common(top)]
    lines.append("  self:")
    lines += [f"    {count / total:6.1%}  {frame}" for frame, count in own.most_common(top)]
    return "\n".join(lines)


def _short(frame: str) -> str:
    """`function (path/to/module.py:LINE)` without the line and with a short path."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/services/", "/clients/python/", "/lib/python3"):
        if marker in where:
            where = where.split(marker, 1)[1]
            break
    return f"{name} ({where})"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_summary")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in sorted(args.directory.glob("*.txt")):
        print(summarise(path, args.top))
        print()


if __name__ == "__main__":
    main()
