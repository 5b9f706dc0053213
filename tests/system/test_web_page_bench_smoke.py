"""`python -m bench.web_page` on a tiny size, so that it cannot rot (it did once: its services
moved to internal listeners and the bench did not follow). Benchmarks themselves are not tests."""

from __future__ import annotations

import pytest

from toolmesh_testing import run_to_end

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_the_page_bench_prints_both_hosts_and_the_pages_requests() -> None:
    completed = run_to_end(
        "-m", "bench.web_page", "--calls", "10", "--warmup", "5", "--concurrency", "8", "--seconds", "1"
    )
    assert "python host" in completed.stdout
    assert "page (Chromium)" in completed.stdout
    # The page's result submissions, one way or the other, for every call.
    assert "page requests per call under load: " in completed.stdout
    assert "SubmitToolResult" in completed.stdout
