"""``pytest-dflash selftest --repeat K``'s counting, and ``Route.hit_source``'s contract."""

from __future__ import annotations

import pytest

from pytest_dflash.routes.families import Family
from pytest_dflash.routes.registry import RegistryError, Route, RouteRegistry
from pytest_dflash.selftest import repeat


def _route(tests: list[str], planted: dict | None = None) -> dict:
    entry = {
        "required": ["validation_cost"],
        "gates": {
            "validation_cost": {
                "status": "pending",
                "tests": [{"nodeid": f"t{i}", "outcome": o} for i, o in enumerate(tests)],
            }
        },
    }
    if planted is not None:
        entry["planted"] = planted
    return entry


def _report(route: list[str], copy: list[str], slow: list[str]) -> dict:
    return {
        "routes": {
            "g.f.r": _route(route),
            "g.f.r~copy": _route(copy, {"from": "g.f.r", "defect": "copy"}),
            "g.f.r~verify_cost_5pct": _route(slow, {"from": "g.f.r", "defect": "verify_cost_5pct"}),
        }
    }


def test_repeat_counts_pass_inconclusive_fail_per_planted_route():
    reports = [
        _report(["passed"], ["passed"], ["failed"]),
        _report(["passed", "inconclusive"], ["inconclusive"], ["failed"]),
        _report(["passed"], ["passed", "skipped"], ["error"]),
        _report([], ["passed"], ["failed"]),  # the route itself deselected (-k) in this run
    ]
    section = repeat.tally(reports)
    counts = section["routes"]["g.f.r"]["validation_cost"]
    assert section["runs"] == 4
    assert counts["route"] == {"pass": 2, "inconclusive": 1, "fail": 0, "error": 0, "pending": 0}
    assert counts["copy"] == {"pass": 2, "inconclusive": 1, "fail": 0, "error": 0, "pending": 1}
    assert counts["verify_cost_5pct"]["fail"] == 3 and counts["verify_cost_5pct"]["error"] == 1
    lines = repeat.render(section)
    assert lines[2].split()[2] == "route" and lines[3].split()[2] == "copy"  # route, copy, rungs
    assert lines[2].split()[3] == "3"  # measured in 3 of the 4 runs
    assert lines[3].split()[3:8] == ["4", "2", "1", "0", "1"]


def test_hit_source_must_be_a_route_of_the_same_family():
    registry = RouteRegistry()
    registry.declare(Family("a.b", None, baseline="a.b.base", gates=("speed",)))
    registry.register(Route("a.b.base", "a.b", "baseline", impl="m:x"))
    registry.register(
        Route(
            "a.b.copy",
            "a.b",
            "candidate",
            baseline="a.b.base",
            gates=("speed",),
            impl="m:x",
            hit_source="a.b.missing",
        )
    )
    with pytest.raises(
        RegistryError,
        match="hit_source 'a.b.missing', which is not a registered route of family 'a.b'",
    ):
        registry.validate()


INTERRUPTER = """
import os
import pathlib


def pytest_collection_finish(session):
    marker = pathlib.Path(os.environ["DFLASH_TEST_INTERRUPT_MARK"])
    if marker.exists():  # the second run: interrupted, as Ctrl-C would
        raise KeyboardInterrupt
    marker.write_text("first run done")
"""


def test_an_interrupted_repeat_counts_the_runs_that_finished(tmp_path, monkeypatch, capsys):
    """Real pytest runs: the first finishes (collection only), the second is interrupted; the
    counts cover the finished run and say how many were asked for, nothing is lost."""
    (tmp_path / "interrupter_plugin.py").write_text(INTERRUPTER)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("DFLASH_TEST_INTERRUPT_MARK", str(tmp_path / "mark"))
    section = repeat.run(3, tmp_path / "r.json", ["--co", "-p", "interrupter_plugin",
                                                  "--dflash-profile", "quick"])
    assert section["runs"] == 1 and section["runs_asked"] == 3
    assert section["reports"] == [str(tmp_path / "r.run0.json")]
    assert "counting the 1 finished runs" in capsys.readouterr().out
    assert (tmp_path / "r.repeat.json").is_file()


def test_a_repeat_that_selects_no_test_is_a_clear_error_without_a_traceback(tmp_path):
    """A real CLI run whose -k matches no gate test of the route (gemm.nvfp4.qpn2_packed does
    not require the GEMM speed gate): pytest exits 5 in the first run, and the command says so
    and how to fix it, exit 2, no traceback."""
    import subprocess
    import sys

    report = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, "-m", "pytest_dflash.cli", "selftest", str(report), "--repeat", "2",
         "--run", "--dflash-route", "gemm.nvfp4.qpn2_packed", "--dflash-profile", "quick",
         "-k", "gemm_speed_large_m"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "self-test run 1 of 2 ended with pytest exit 5: it selected no test" in done.stderr
    assert "select a timing gate the route requires" in done.stderr
    assert not (tmp_path / "r.run1.json").exists()  # the second run never started
