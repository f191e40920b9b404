"""A failed gate is settled: its remaining tests for that route are skipped, naming the failure.

Through the real plugin (pytester), a toy family whose gate has three sizes:
- a candidate wrong at the first size fails it, and its other two sizes are skipped with the
  node id of the failing test; the gate stays failed and the route rejected;
- one wrong only at the second size runs the first two and skips the third;
- a correct candidate runs every size, and other gates of a failed route still run;
- a harness error (the suite raised) is not a failure and settles nothing;
- ``--dflash-every-test`` (and ini ``dflash_every_test``) runs every test, with the same verdicts,
  and the self-test's calibration always does;
- a report that a settled run wrote is read back by `pytest-dflash verdict` as a rejection.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from toyproject import toy_project

CONFTEST = """
from typing import Protocol, runtime_checkable

from pytest_dflash import Family, Route


@runtime_checkable
class Adder(Protocol):
    def add(self, a: int, b: int) -> int: ...


class Impl:
    def __init__(self, wrong_from=None):
        self.wrong_from = wrong_from

    def add(self, a, b):
        return a + b + (1 if self.wrong_from is not None and a >= self.wrong_from else 0)


BASE, GOOD = Impl(), Impl()
WRONG_FIRST, WRONG_SECOND = Impl(wrong_from=1), Impl(wrong_from=2)


def pytest_dflash_routes(registry):
    registry.declare(Family("toy.add", Adder, baseline="toy.add.base", gates=("parity", "ppl")))
    registry.register(Route("toy.add.base", "toy.add", "baseline", impl="conftest:BASE"))
    for name, impl in (("good", "GOOD"), ("wrong_first", "WRONG_FIRST"),
                       ("wrong_second", "WRONG_SECOND")):
        registry.register(Route(f"toy.add.{name}", "toy.add", "candidate",
                                baseline="toy.add.base", gates=("parity", "ppl"),
                                impl=f"conftest:{impl}"))
"""

GATES = """
import os

import pytest


@pytest.mark.gate("parity", family="toy.add")
@pytest.mark.parametrize("size", [1, 2, 3])
def test_parity(dflash_gate, size):
    if os.environ.get("TOY_SUITE_BUG") and size == 1:
        {}["a key the suite forgot"]
    got, want = dflash_gate.impl.add(size, 3), dflash_gate.baseline.add(size, 3)
    dflash_gate.record(figure=f"size {size}: {got} vs {want}")
    assert got == want


@pytest.mark.gate("ppl", family="toy.add")
def test_other_gate(dflash_gate):
    dflash_gate.record(figure="ran")
"""


@pytest.fixture
def toy(pytester: pytest.Pytester) -> pytest.Pytester:
    return toy_project(pytester, CONFTEST, test_gates=GATES)


def run(pytester: pytest.Pytester, *extra: str) -> tuple[pytest.RunResult, dict]:
    result = pytester.runpytest("--dflash-route", "toy.add.good", "--dflash-route",
                                "toy.add.wrong_first", "--dflash-route", "toy.add.wrong_second",
                                *extra, "-p", "no:cacheprovider", "-rs")
    return result, json.loads((pytester.path / "dflash-report.json").read_text())


def outcomes(report: dict, route: str) -> list[str]:
    return [t["outcome"] for t in report["routes"][route]["gates"]["parity"]["tests"]]


def test_a_failed_gate_skips_its_later_tests_naming_the_failure(toy: pytest.Pytester) -> None:
    result, report = run(toy)
    first = "test_gates.py::test_parity[toy.add.wrong_first-1]"
    assert outcomes(report, "toy.add.wrong_first") == ["failed", "skipped", "skipped"]
    for test in report["routes"]["toy.add.wrong_first"]["gates"]["parity"]["tests"][1:]:
        assert test["message"].startswith(
            f"settled: toy.add.wrong_first's parity gate already failed at {first}")
        assert "--dflash-every-test" in test["message"]
    assert outcomes(report, "toy.add.wrong_second") == ["passed", "failed", "skipped"]
    assert outcomes(report, "toy.add.good") == ["passed", "passed", "passed"]
    for name in ("toy.add.wrong_first", "toy.add.wrong_second"):
        entry = report["routes"][name]
        assert entry["gates"]["parity"]["status"] == "failed"
        assert entry["verdict"] == "reject"
        # another gate of a rejected route still runs: only the failed gate is settled
        assert entry["gates"]["ppl"]["status"] == "passed"
    assert report["routes"]["toy.add.wrong_first"]["gates"]["parity"]["figure"].startswith(
        "size 1: 5 vs 4")
    assert report["routes"]["toy.add.good"]["verdict"] == "accept"
    result.assert_outcomes(passed=7, failed=2, skipped=3)
    # -rs prints each skip's reason: the terminal says which test settled the gate
    assert f"settled: toy.add.wrong_first's parity gate already failed at {first}" in str(
        result.stdout)

    verdict = subprocess.run([sys.executable, "-m", "pytest_dflash.cli", "verdict",
                              "dflash-report.json", "--format", "json"], cwd=toy.path,
                             capture_output=True, text=True, timeout=120)
    summary = json.loads(verdict.stdout)
    assert summary["routes"]["toy.add.wrong_first"]["verdict"] == "reject"
    assert summary["routes"]["toy.add.wrong_first"]["gates"]["parity"]["status"] == "failed"


@pytest.mark.parametrize("how", ["option", "ini"])
def test_every_test_runs_them_all_with_the_same_verdicts(toy: pytest.Pytester, how: str) -> None:
    if how == "ini":
        toy.makeini("[pytest]\ndflash_every_test = true\n")
    result, report = run(toy, *(["--dflash-every-test"] if how == "option" else []))
    assert outcomes(report, "toy.add.wrong_first") == ["failed", "failed", "failed"]
    assert outcomes(report, "toy.add.wrong_second") == ["passed", "failed", "failed"]
    assert report["routes"]["toy.add.wrong_first"]["verdict"] == "reject"
    assert report["routes"]["toy.add.good"]["verdict"] == "accept"
    result.assert_outcomes(passed=7, failed=5)


def test_a_harness_error_settles_nothing(toy: pytest.Pytester,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite raised at size 1: not the candidate's failure, so sizes 2 and 3 still run."""
    monkeypatch.setenv("TOY_SUITE_BUG", "1")
    _, report = run(toy)
    assert outcomes(report, "toy.add.good") == ["error", "passed", "passed"]
    assert outcomes(report, "toy.add.wrong_second") == ["error", "failed", "skipped"]
    assert outcomes(report, "toy.add.wrong_first") == ["error", "failed", "skipped"]


def test_the_selftest_calibration_runs_every_test(pytester: pytest.Pytester) -> None:
    """What the calibration measures is which slowdown each size resolves: no test is settled."""
    from pytest_dflash import settings

    assert not settings.of(pytester.parseconfigure()).every_test
    config = pytester.parseconfigure("--dflash-selftest", "--dflash-selftest-calibrate")
    assert settings.of(config).every_test
