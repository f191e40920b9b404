"""``pytest-dflash selftest --run`` interrupted from outside, as ``timeout -s INT`` does it.

The interrupt reaches the command's process alone; the command must pass it on to the child
pytest session, wait for it to write its report, and end with exit 2 and no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SLEEPER = """
import os
import pathlib
import time


def pytest_runtest_call(item):
    pathlib.Path(os.environ["DFLASH_TEST_STARTED"]).write_text(item.nodeid)
    time.sleep(300)  # a long test, stopped by the interrupt after its setup
"""


def test_an_interrupted_selftest_run_keeps_its_report(tmp_path: Path) -> None:
    (tmp_path / "sleeper_plugin.py").write_text(SLEEPER)
    started = tmp_path / "started"
    report = tmp_path / "selftest.json"
    env = {**os.environ, "DFLASH_TEST_STARTED": str(started),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest_dflash.cli", "selftest", str(report), "--run",
         "-p", "sleeper_plugin", "-p", "no:cacheprovider", "--dflash-profile", "quick",
         "--dflash-route", "gemm.nvfp4.qpn2", "-k", "parity"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a shell's background job inherits SIGINT ignored, and so would the command: restored,
        # as in a terminal or under ``timeout -s INT``
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not started.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the child session never started a test"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # the command alone, not its child
        out, err = proc.communicate(timeout=200)
    finally:
        proc.kill()
    assert proc.returncode == 2, (out, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    assert f"{report} holds the tests that finished" in err
    written = json.loads(report.read_text())
    assert written["session"]["interrupted"] is True
    outcomes = [t["outcome"] for e in written["routes"].values()
                for g in e.get("gates", {}).values() for t in g.get("tests", [])]
    assert outcomes == ["interrupted"], outcomes


def test_the_child_names_its_report_with_an_equals_sign(tmp_path: Path) -> None:
    """pytest picks the rootdir before it knows the plugin's options: a report path that already
    exists (the second run of one command), written after a space, would count as a test path
    and move the child's rootdir out of the project (docs/report.md)."""
    from pytest_dflash.selftest import child

    report = tmp_path / "selftest.json"
    report.write_text("{}")
    for calibrate in (False, True):
        argv = child.command(report, ["-q"], calibrate=calibrate)
        assert f"--dflash-report={report}" in argv and str(report) not in argv, argv


def test_the_calibration_child_selects_every_timing_gate(tmp_path: Path) -> None:
    """``--repeat`` runs the calibration child: its selection must hold every timing gate kind
    the calibration plants slowdowns for, the cold prefill as much as speed and
    validation_cost (it once selected only the latter two, and the prefill's copy and
    slowdowns were never timed)."""
    from pytest_dflash.selftest import child

    argv = child.command(tmp_path / "r.json", ["--collect-only", "--dflash-route",
                                                "gemm.nvfp4.qpn2_packed"], calibrate=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("PYTEST_XDIST")})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    for test in ("test_speed_cold_prefill", "test_gemm_validation_cost_verify_m"):
        routes = {line.split("[", 1)[1].split("-")[0].rstrip("]") for line in collected
                  if test in line}
        assert {"gemm.nvfp4.qpn2_packed", "gemm.nvfp4.qpn2_packed~copy"} <= routes, collected
