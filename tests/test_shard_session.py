"""``--dflash-shard K/N`` in real pytest runs (pytester) of a toy family: the report records the
plan, an empty shard exits 0 saying so, a bad K/N is a usage error, and the shards of one
selection cover it once, with xdist too."""

from __future__ import annotations

import json

import pytest

TOY = """
from pytest_dflash import Family, Route
def pytest_dflash_routes(registry):
    registry.declare(Family("toy.mul", None, baseline="toy.mul.base", gates=("parity", "speed")))
    registry.register(Route("toy.mul.base", "toy.mul", "baseline"))
    for name in ("a", "b"):
        registry.register(Route(f"toy.mul.{name}", "toy.mul", "candidate",
                                baseline="toy.mul.base", gates=("parity", "speed")))
"""

GATES = """
import pytest

@pytest.mark.gate("parity", family="toy.mul")
@pytest.mark.parametrize("case", range(3))
def test_parity(dflash_route, dflash_record, case):
    dflash_record(figure=f"case {case} exact")

@pytest.mark.gate("speed", family="toy.mul")
@pytest.mark.parametrize("size", (8, 16))
def test_speed(dflash_route, dflash_record, size):
    dflash_record(figure="recorded, not timed: the split is under test here")
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_gates=GATES)
    return pytester


def _report(pytester: pytest.Pytester, name: str) -> dict:
    return json.loads((pytester.path / name).read_text())


def _ran(report: dict) -> set[str]:
    return {t["nodeid"] for e in report["routes"].values() for g in e["gates"].values()
            for t in g["tests"]}


def test_the_shards_cover_the_selection_once_and_keep_timing_gates_whole(
        project: pytest.Pytester) -> None:
    ran: list[set[str]] = []
    for k in (1, 2, 3):
        result = project.runpytest(f"--dflash-shard={k}/3", f"--dflash-report=s{k}.json")
        assert result.ret == 0
        data = _report(project, f"s{k}.json")
        assert (data["shard"]["index"], data["shard"]["count"]) == (k, 3)
        assert data["shard"]["selected"] == 10 and data["shard"]["costs"] == "count"
        ran.append(_ran(data))
    assert sum(len(r) for r in ran) == 10 and len(set().union(*ran)) == 10
    plans = {_report(project, f"s{k}.json")["shard"]["plan_sha256"] for k in (1, 2, 3)}
    assert len(plans) == 1  # every shard cut the same plan
    for route in ("a", "b"):
        speed = {n for n in set().union(*ran) if n.startswith("test_gates.py::test_speed")
                 and f"toy.mul.{route}" in n}
        assert len(speed) == 2 and sum(bool(speed & r) for r in ran) == 1


def test_a_shard_that_gets_nothing_says_so_and_exits_0(project: pytest.Pytester) -> None:
    result = project.runpytest("--dflash-shard=9/9", "-k", "test_speed")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*dflash: shard 9/9 got no test of the 4 selected: nothing to "
                                 "run here*"])
    data = _report(project, "dflash-report.json")
    assert data["shard"]["assigned"] == 0 and not _ran(data)


@pytest.mark.parametrize("value", ["4/3", "two/3", "0/1"])
def test_a_bad_shard_is_a_usage_error_naming_the_form(project: pytest.Pytester,
                                                      value: str) -> None:
    result = project.runpytest(f"--dflash-shard={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--dflash-shard*{value}*K/N with whole numbers 1 <= K <= N*"])


def test_costs_from_a_report_balance_the_split(project: pytest.Pytester) -> None:
    """A report saying one route's speed gate took 100 s puts that gate alone in a shard."""
    project.runpytest("--dflash-report=costs.json").assert_outcomes(passed=10)
    costs = _report(project, "costs.json")
    for test in costs["routes"]["toy.mul.a"]["gates"]["speed"]["tests"]:
        test["duration_s"] = 50.0
    (project.path / "costs.json").write_text(json.dumps(costs))
    shares = []
    for k in (1, 2):
        project.runpytest(f"--dflash-shard={k}/2", "--dflash-shard-costs=costs.json",
                          f"--dflash-report=s{k}.json")
        data = _report(project, f"s{k}.json")
        assert data["shard"]["costs"].startswith("costs.json (")
        shares.append(_ran(data))
    alone = next(s for s in shares if any("toy.mul.a" in n and "speed" in n for n in s))
    assert alone == {"test_gates.py::test_speed[toy.mul.a-8]",
                     "test_gates.py::test_speed[toy.mul.a-16]"}


def test_shards_combine_with_xdist(project: pytest.Pytester) -> None:
    """Each xdist worker cuts the same share as a run without xdist, and the controller's
    report records the plan (timing gates are refused in CPU workers: recorded as skipped)."""
    pytest.importorskip("xdist")
    whole = project.runpytest("--dflash-shard=2/3", "--dflash-report=plain.json")
    result = project.runpytest_subprocess("-n", "2", "--dflash-shard=2/3",
                                          "--dflash-report=xdist.json")
    plain, xdist = _report(project, "plain.json"), _report(project, "xdist.json")
    assert whole.ret == 0 and result.ret == 0
    assert xdist["shard"] == {**plain["shard"], "host": xdist["shard"]["host"]}
    assert _ran(xdist) == _ran(plain) and len(_ran(plain)) == plain["shard"]["assigned"]
