"""A crash is not a verdict: whose code raised decides what a raising gate test means.

Through the real plugin (pytester): an exception from the candidate's own code (its
implementation, the engine built for its selection) fails the gate and rejects the route,
naming the exception; one from anywhere else (the suite, the baseline, a fixture, the gate's
contract check, the baseline's engine) is an ERROR that leaves the gate and the route pending,
fails a strict run, and is read back by `pytest-dflash verdict`, `diff` and `enable` as neither
accepted nor rejected.
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
    def __init__(self, name, bug=None):
        self.name, self.bug = name, bug

    def add(self, a, b):
        if self.bug == "raise" and a == 7:
            raise ZeroDivisionError("planted: the kernel divides by zero on a valid input")
        return a + b


class Engine:
    '''A toy engine: the candidate selection's instance raises where the conftest says.'''

    def __init__(self, selection):
        self.selection = selection

    def score(self, ids):
        route = self.selection.get("toy.add")
        if route in RAISING_ENGINES:
            raise RuntimeError(f"planted: the engine of {route} breaks on a valid request")
        return [-1.0 for _ in ids]

    def close(self):
        pass


BASE, GOOD, RAISES = Impl("toy.add.base"), Impl("toy.add.good"), Impl("toy.add.raises", "raise")
NONE = object()  # offers no `add`: the gate's contract check refuses it
RAISING_ENGINES = {"toy.add.engine_raises"}


def pytest_dflash_routes(registry):
    registry.declare(Family("toy.add", Adder, baseline="toy.add.base", gates=("parity", "ppl")))
    registry.register(Route("toy.add.base", "toy.add", "baseline", impl="conftest:BASE"))
    for name, impl in (("good", "GOOD"), ("raises", "RAISES"), ("no_contract", "NONE"),
                       ("engine_raises", "GOOD")):
        registry.register(Route(f"toy.add.{name}", "toy.add", "candidate",
                                baseline="toy.add.base", gates=("parity", "ppl"),
                                impl=f"conftest:{impl}"))


def pytest_dflash_engine(config, selection, profile):
    return Engine(selection)
"""

GATES = """
import os

import pytest


@pytest.mark.gate("parity", family="toy.add")
def test_parity(dflash_gate):
    impl, base = dflash_gate.impl, dflash_gate.baseline
    if os.environ.get("TOY_SUITE_BUG"):
        {}["a key the suite forgot"]
    errors = [abs(impl.add(a, 3) - base.add(a, 3)) for a in range(10)]
    dflash_gate.record(figure=f"max abs {max(errors)}")
    assert max(errors) == 0


@pytest.mark.gate("ppl", family="toy.add")
def test_ppl(dflash_gate):
    baseline, candidate = dflash_gate.engines()
    delta = abs(sum(candidate.score([1, 2, 3])) - sum(baseline.score([1, 2, 3])))
    dflash_gate.record(figure=f"delta {delta}")
    assert delta == 0
"""

FIXTURE_BUG = """
import pytest


@pytest.fixture(autouse=True)
def broken_fixture():
    raise OSError("planted: a fixture of the suite cannot open its data")
"""


@pytest.fixture
def toy(pytester: pytest.Pytester) -> pytest.Pytester:
    return toy_project(pytester, CONFTEST, test_gates=GATES)


def run(pytester: pytest.Pytester, *routes: str, extra: tuple[str, ...] = (),
        report: str = "dflash-report.json") -> tuple[pytest.RunResult, dict]:
    args = [a for r in routes for a in ("--dflash-route", r)]
    result = pytester.runpytest(*args, *extra, "-p", "no:cacheprovider",
                                "--dflash-report", report)
    return result, json.loads((pytester.path / report).read_text())


def cli(pytester: pytest.Pytester, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest_dflash.cli", *args],
                          cwd=pytester.path, capture_output=True, text=True, timeout=120)


def test_a_candidate_that_raises_is_rejected_naming_the_exception(toy: pytest.Pytester) -> None:
    result, report = run(toy, "toy.add.raises", "toy.add.good")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    entry = report["routes"]["toy.add.raises"]
    test = entry["gates"]["parity"]["tests"][0]
    assert test["outcome"] == "failed"
    assert test["raised"]["exception"] == "ZeroDivisionError"
    assert test["raised"]["origin"] == "candidate"
    assert test["raised"]["where"].startswith("conftest.py:")
    assert entry["verdict"] == "reject"
    assert "ZeroDivisionError" in entry["reasons"][0]
    assert report["routes"]["toy.add.good"]["verdict"] == "accept"
    result.stdout.fnmatch_lines(["toy.add.raises*FAIL*REJECT*",
                                 "*the candidate raised ZeroDivisionError*"])


def test_the_candidates_engine_raising_rejects_the_baselines_does_not(
        toy: pytest.Pytester) -> None:
    """Same engine class, two instances: only the candidate selection's counts as its code."""
    _, report = run(toy, "toy.add.engine_raises")
    ppl = report["routes"]["toy.add.engine_raises"]["gates"]["ppl"]
    assert ppl["status"] == "failed"
    assert ppl["tests"][0]["raised"]["origin"] == "candidate"

    (toy.path / "conftest.py").write_text(CONFTEST.replace(
        'RAISING_ENGINES = {"toy.add.engine_raises"}', 'RAISING_ENGINES = {"toy.add.base"}'))
    _, report = run(toy, "toy.add.engine_raises")
    entry = report["routes"]["toy.add.engine_raises"]
    assert entry["gates"]["ppl"]["status"] == "error"
    assert entry["gates"]["ppl"]["tests"][0]["raised"]["origin"] == "harness"
    assert entry["verdict"] == "pending"


def test_a_suite_that_raises_leaves_the_route_pending_as_error(
        toy: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    _, accepted = run(toy, "toy.add.good", report="good.json")
    assert accepted["routes"]["toy.add.good"]["verdict"] == "accept"

    monkeypatch.setenv("TOY_SUITE_BUG", "1")
    result, report = run(toy, "toy.add.good", report="broken.json")
    entry = report["routes"]["toy.add.good"]
    test = entry["gates"]["parity"]["tests"][0]
    assert test["outcome"] == "error"
    assert test["raised"] == {"exception": "KeyError", "message": "'a key the suite forgot'",
                              "where": "test_gates.py:10 in test_parity", "origin": "harness"}
    assert entry["gates"]["parity"]["status"] == "error"
    assert entry["verdict"] == "pending"
    assert entry["reasons"][0].startswith("parity ERROR: KeyError")
    assert "the harness, not the candidate" in entry["reasons"][0]
    result.stdout.fnmatch_lines(["toy.add.good*ERROR*pass*PENDING*",
                                 "*raised at test_gates.py:10 in test_parity*"])
    # the candidate's own code was fine and still raised nothing: a failure would be a lie
    assert "REJECT" not in result.stdout.str()

    verdict = cli(toy, "verdict", "broken.json", "--format", "json")
    assert verdict.returncode == 1, verdict.stderr
    summary = json.loads(verdict.stdout)
    assert summary["routes"]["toy.add.good"]["verdict"] == "pending"
    assert summary["routes"]["toy.add.good"]["gates"]["parity"]["status"] == "error"
    enable = cli(toy, "enable", "broken.json")
    assert "TOY_ADD_GOOD" not in enable.stdout, enable.stdout
    assert "TOY_ADD_GOOD=1" in cli(toy, "enable", "good.json").stdout
    diff = cli(toy, "diff", "good.json", "broken.json")
    assert diff.returncode == 1, diff.stdout + diff.stderr
    assert "toy.add.good parity: passed" in diff.stdout and "-> error" in diff.stdout

    strict = pytester_strict = toy.runpytest("--dflash-route", "toy.add.good", "--dflash-strict",
                                             "-p", "no:cacheprovider")
    assert pytester_strict.ret == pytest.ExitCode.TESTS_FAILED
    strict.stdout.fnmatch_lines(["*strict mode: the harness raised (ERROR*toy.add.good parity*"])


@pytest.mark.parametrize("how", ["baseline", "contract", "fixture"])
def test_the_baseline_a_contract_check_or_a_fixture_raising_is_an_error(
        toy: pytest.Pytester, how: str) -> None:
    route = "toy.add.no_contract" if how == "contract" else "toy.add.good"
    if how == "baseline":
        (toy.path / "conftest.py").write_text(CONFTEST.replace(
            'BASE, GOOD, RAISES = Impl("toy.add.base")',
            'BASE, GOOD, RAISES = Impl("toy.add.base", "raise")'))
    if how == "fixture":
        (toy.path / "test_gates.py").write_text(GATES + FIXTURE_BUG)
    result, report = run(toy, route, extra=("-k", "parity"))
    entry = report["routes"][route]
    test = entry["gates"]["parity"]["tests"][0]
    assert test["outcome"] == "error", test
    assert test["raised"]["origin"] == "harness"
    expected = {"baseline": "ZeroDivisionError", "contract": "TypeError", "fixture": "OSError"}
    assert test["raised"]["exception"] == expected[how]
    assert entry["verdict"] == "pending"
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # pytest's own status: the test errored
