"""The ``pytest-dflash`` command on real report files, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytest_dflash import report as reports
from pytest_dflash.registry import Route


def _report(tmp_path: Path, name: str, parity: str, speed: str, *, head: str = "abc") -> Path:
    route = Route("toy.add.fast", "toy.add", "candidate", baseline="toy.add.base",
                  gates=("parity", "speed"))
    other = Route("toy.add.slow", "toy.add", "candidate", baseline="toy.add.base",
                  gates=("parity",), switch="TOY_SLOW")
    data = reports.new_report(routes=[route, other], fingerprint={"git_head": head},
                              device={"name": "cpu"}, profile="ci", policy={})
    for kind, outcome in (("parity", parity), ("speed", speed)):
        if outcome:
            reports.add_test(data, route.name, kind, {
                "nodeid": f"t.py::test_{kind}[toy.add.fast]", "outcome": outcome,
                "duration_s": 0.1, "message": "", "measurements": {"figure": f"{kind} {outcome}"}})
    reports.add_test(data, other.name, "parity", {
        "nodeid": "t.py::test_parity[toy.add.slow]", "outcome": "passed", "duration_s": 0.1,
        "message": "", "measurements": {}})
    path = tmp_path / name
    reports.write_atomic(data, path)
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_dflash.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_verdict_exit_status_follows_the_verdicts(tmp_path: Path) -> None:
    accepted = _cli("verdict", str(_report(tmp_path, "a.json", "passed", "passed")))
    assert accepted.returncode == 0, accepted.stdout
    assert "toy.add.fast" in accepted.stdout and "ACCEPT" in accepted.stdout
    rejected = _cli("verdict", str(_report(tmp_path, "b.json", "passed", "failed")))
    assert rejected.returncode == 1
    assert "REJECT" in rejected.stdout and "speed failed" in rejected.stdout
    pending = _cli("verdict", str(_report(tmp_path, "c.json", "passed", "")))
    assert pending.returncode == 1
    assert "speed pending: did not run" in pending.stdout


def test_enable_prints_switches_of_accepted_routes_only(tmp_path: Path) -> None:
    done = _cli("enable", str(_report(tmp_path, "a.json", "passed", "failed")))
    assert done.returncode == 0
    assert done.stdout.splitlines() == ["TOY_SLOW=1"]
    done = _cli("enable", str(_report(tmp_path, "b.json", "passed", "passed")))
    assert done.stdout.splitlines() == ["DFLASH_TOY_ADD_FAST=1", "TOY_SLOW=1"]


def test_diff_names_route_gate_and_fingerprint_changes(tmp_path: Path) -> None:
    old = _report(tmp_path, "old.json", "passed", "failed")
    new = _report(tmp_path, "new.json", "passed", "passed", head="def")
    done = _cli("diff", str(old), str(new))
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert "toy.add.fast: verdict reject -> accept" in lines
    assert "toy.add.fast speed: failed (speed failed) -> passed (speed passed)" in lines
    assert "fingerprint changed: git_head" in lines
    same = _cli("diff", str(old), str(old))
    assert same.stdout.strip() == "no differences"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"schema": "pytest-dflash/report/1", "routes": ', "corrupt report, not valid JSON"),
        ('{"stats": {}, "machine_info": {}}', "not a pytest-dflash report"),
        ("[1, 2, 3]", "not a pytest-dflash report"),
        ('{"schema": "pytest-dflash/report/1", "routes": {}}', "report lacks created"),
        (b"\xff\xfe\x00garbage", "cannot read report"),
    ],
)
def test_corrupt_or_foreign_reports_exit_2_with_a_clear_error(
    tmp_path: Path, content: str | bytes, message: str
) -> None:
    path = tmp_path / "r.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    for command in (["verdict", str(path)], ["enable", str(path)], ["diff", str(path), str(path)]):
        done = _cli(*command)
        assert done.returncode == 2, (command, done.stdout)
        assert message in done.stderr
        assert "Traceback" not in done.stderr


def test_missing_report_exit_2(tmp_path: Path) -> None:
    done = _cli("verdict", str(tmp_path / "nope.json"))
    assert done.returncode == 2
    assert "no such report" in done.stderr


def test_console_script_is_installed() -> None:
    done = subprocess.run(["pytest-dflash", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    for verb in ("verdict", "diff", "enable", "build"):
        assert verb in done.stdout
