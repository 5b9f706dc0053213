"""The README's parts that are rendered from the code agree with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_readme_error_tables_are_rendered_from_the_tables() -> None:
    script = Path(__file__).resolve().parent.parent / "scripts" / "render_error_table.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
