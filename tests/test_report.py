"""Report file mechanics: atomic writes and verdict recomputation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_dflash import report as reports
from pytest_dflash.registry import Route
from pytest_dflash.verdict import gate_status, route_verdict

ROUTE = Route("toy.a.fast", "toy.a", "candidate", baseline="toy.a.base",
              gates=("parity", "speed"))


def _evidence() -> dict:
    return reports.new_report(routes=[ROUTE], fingerprint={"git_head": "x"}, device={},
                              profile="ci", policy={})


def test_failed_write_leaves_the_previous_report_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "r.json"
    reports.write_atomic(_evidence(), path)
    before = path.read_text()

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", explode)
    with pytest.raises(OSError, match="disk full"):
        reports.write_atomic(_evidence(), path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize(
    ("outcomes", "status"),
    [([], "pending"), (["passed"], "passed"), (["passed", "skipped"], "pending"),
     (["passed", "failed"], "failed"), (["skipped", "error"], "failed"), (["skipped"], "pending")],
)
def test_gate_status_never_counts_a_skip_as_a_pass(outcomes: list[str], status: str) -> None:
    assert gate_status([{"outcome": o} for o in outcomes]) == status


def test_route_verdict_reject_beats_pending_and_names_each_gate() -> None:
    gates = {"parity": {"status": "failed", "tests": [{"nodeid": "n", "outcome": "failed",
                                                        "message": "bad"}]},
             "speed": {"status": "pending", "tests": []}}
    verdict, reasons = route_verdict(["parity", "speed"], gates)
    assert verdict == "reject"
    assert reasons == ["parity failed: bad", "speed pending: did not run in this evidence"]
    assert route_verdict(["parity"], {"parity": {"status": "passed", "tests": []}})[0] == "accept"


def test_add_test_replaces_by_node_id() -> None:
    data = _evidence()
    for outcome in ("failed", "passed"):
        reports.add_test(data, ROUTE.name, "parity", {"nodeid": "t::p", "outcome": outcome})
    assert [t["outcome"] for t in data["routes"][ROUTE.name]["gates"]["parity"]["tests"]] == [
        "passed"]


def test_gate_figure_shows_failures_first_then_the_worst_margin() -> None:
    from pytest_dflash.verdict import gate_figure

    def test(outcome: str, figure: str, rel_l2: float) -> dict:
        return {"outcome": outcome, "measurements": {"figure": figure, "rel_l2": rel_l2,
                                                     "rel_l2_limit": 1e-5}}

    tests = [test("passed", "small", 1e-7), test("passed", "worst", 9e-6),
             test("passed", "middle", 1e-6)]
    assert gate_figure(tests, limit=1) == "worst (+2 more)"
    tests.append(test("failed", "broken", 1e-8))
    assert gate_figure(tests) == "broken; worst (+2 more)"
