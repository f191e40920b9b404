"""The worked example of the root conftest.py: a local route, opt-in, gated by the shipped suite.

Run in a fresh interpreter at the repository root so this repository's own pyproject and
conftest are in force, exactly as for the main job.
"""

from __future__ import annotations

import json


def test_example_route_is_gated_by_the_shipped_parity_suite(run_repo_pytest) -> None:
    done, report = run_repo_pytest(
        "suites/test_parity_attn.py", "--example-route", "--dflash-route", "attn.d256.example",
        "--dflash-profile", "quick", "-k", "edges or paged")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    routes = json.loads(report.read_text())["routes"]
    assert set(routes) == {"attn.d256.example"}
    parity = routes["attn.d256.example"]["gates"]["parity"]
    assert parity["status"] == "passed" and len(parity["tests"]) == 6, parity
    assert all(t["outcome"] == "passed" for t in parity["tests"])


def test_example_route_is_opt_in(run_repo_pytest) -> None:
    """Without --example-route the main job knows nothing of it: the verdict table of
    ``pytest -m sm70`` stays the shipped stack's."""
    done, _ = run_repo_pytest("suites/test_parity_attn.py", "--dflash-route",
                              "attn.d256.example", "--co", "-q")
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]  # usage error
    assert "unknown route 'attn.d256.example'" in done.stderr
