"""The child pytest session of ``pytest-dflash selftest --run`` and ``--repeat``.

The self-test commands run the gate suites in a pytest process of their own. An interrupt
(Ctrl-C, or ``timeout -s INT`` around a CI job) must reach that child exactly once, so that it
stops the test that is running and still writes its report: the tests that finished are
evidence, and the catch table is printed from them. The child therefore runs in its own process
group (a terminal's Ctrl-C reaches the command alone) and the command passes the interrupt on,
then waits for the child to close its timing workers and write the report.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pytest_dflash.routes.vocabulary import EXCLUSIVE_KINDS as TIMING_KINDS

#: How long a child may take, after the interrupt, to close its workers and write its report
#: before it is killed (a second Ctrl-C kills it at once).
REPORT_GRACE_S = 120.0


@dataclass(frozen=True)
class ChildResult:
    """A child session's exit status, and whether it was interrupted from outside."""

    code: int
    interrupted: bool


def command(report: Path | str, pytest_args: Sequence[str], *,
            calibrate: bool = False) -> list[str]:
    """The child's command line: the gate suites with ``--dflash-selftest``, writing ``report``.

    ``calibrate`` runs the timing gates alone (every kind: speed, prefill, validation_cost) with
    the planted slowdowns calibrated (``--dflash-selftest-calibrate``), as ``--repeat`` does.
    """
    marks = f"sm70 and ({' or '.join(sorted(TIMING_KINDS))})" if calibrate else "sm70"
    extra = ["--dflash-selftest-calibrate", "-p", "no:cacheprovider", "-q"] if calibrate else []
    return [sys.executable, "-m", "pytest", "--pyargs", "dflash_suites", "-m", marks,
            "--dflash-selftest", *extra, f"--dflash-report={report}", *pytest_args]


def run(argv: Sequence[str]) -> ChildResult:
    """Run ``argv`` as the child session; an interrupt is passed on and the child waited for."""
    proc = subprocess.Popen(list(argv), process_group=0)
    try:
        return ChildResult(proc.wait(), False)
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        print("interrupted: the self-test session stops its test and writes its report",
              flush=True)
        try:
            return ChildResult(proc.wait(timeout=REPORT_GRACE_S), True)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.kill()
            return ChildResult(proc.wait(), True)
