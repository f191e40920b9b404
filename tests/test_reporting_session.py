"""History, comparison, progress, JUnit properties and pytest-benchmark flags in real pytest runs
(pytester), on a toy route family whose gates pass or fail as a file says."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TOY = """
from pytest_dflash import Route

def pytest_dflash_routes(registry):
    registry.register(Route("toy.mul.base", "toy.mul", "baseline"))
    registry.register(Route("toy.mul.fast", "toy.mul", "candidate", baseline="toy.mul.base",
                            gates=("parity", "speed")))
"""

GATES = """
import pathlib
import pytest

@pytest.mark.gate("parity", family="toy.mul")
def test_parity(dflash_route, dflash_record):
    dflash_record(figure="max abs 1e-7")
    assert pathlib.Path("parity.txt").read_text() == "ok"

@pytest.mark.gate("speed", family="toy.mul")
def test_speed(dflash_route, dflash_record):
    dflash_record(figure="ratio 0.900 [0.880, 0.920] over 12 rounds", ci_low=0.88,
                  ci_high=0.92, ratio_median=0.9)
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_gates=GATES)
    pytester.path.joinpath("parity.txt").write_text("ok")
    return pytester


def test_save_then_compare_names_what_got_worse(project: pytest.Pytester) -> None:
    first = project.runpytest("--dflash-save=base")
    first.assert_outcomes(passed=2)
    first.stdout.fnmatch_lines(["saved as .dflash/0001_*_base.json"])
    project.path.joinpath("parity.txt").write_text("broken")
    second = project.runpytest("--dflash-compare=base", "--dflash-save")
    second.assert_outcomes(passed=1, failed=1)
    second.stdout.fnmatch_lines([
        "*dflash verdicts*",
        "compared with .dflash/0001_*_base.json:",
        "  toy.mul.fast: verdict accept -> reject <- worse",
        "  toy.mul.fast parity: passed (max abs 1e-7) -> failed (max abs 1e-7) <- worse",
        "  got worse: 2 (toy.mul.fast, toy.mul.fast parity)",
        "saved as .dflash/0002_*.json",
    ])
    index = json.loads(project.path.joinpath(".dflash", "index.json").read_text())
    assert [(e["seq"], e["name"], e["verdicts"]["reject"]) for e in index] == [
        (1, "base", 0), (2, None, 1)]
    # bare --dflash-compare (last on the line): the newest kept run
    third = project.runpytest("--dflash-compare")
    third.stdout.fnmatch_lines(["compared with .dflash/0002_*.json:", "  no differences"])


def test_compare_without_history_is_reported_not_a_crash(project: pytest.Pytester) -> None:
    result = project.runpytest("--dflash-compare")
    result.assert_outcomes(passed=2)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["dflash: --dflash-compare: nothing to compare with in *"
                                 "no runs are stored yet; save one with --dflash-save"])


def test_bad_save_name_is_a_usage_error(project: pytest.Pytester) -> None:
    result = project.runpytest("--dflash-save=../escape")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--dflash-save '../escape': a run name is 1-64 letters*"])
    assert not project.path.joinpath(".dflash").exists()


def test_junit_has_flat_properties_per_gate_test_and_one_per_verdict(
        project: pytest.Pytester) -> None:
    project.runpytest("--junitxml=out.xml", "--dflash-route=toy.mul.fast").assert_outcomes(
        passed=2)
    root = ET.parse(project.path / "out.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    cases = {case.get("name"): {p.get("name"): p.get("value")
                                for p in case.iter("property")}
             for case in suite.iter("testcase")}
    assert cases["test_speed[toy.mul.fast]"] == {
        "dflash_route": "toy.mul.fast", "dflash_kind": "speed",
        "dflash_figure": "ratio 0.900 [0.880, 0.920] over 12 rounds",
        "dflash_ci_low": "0.88", "dflash_ci_high": "0.92"}
    assert cases["test_parity[toy.mul.fast]"] == {
        "dflash_route": "toy.mul.fast", "dflash_kind": "parity", "dflash_figure": "max abs 1e-7"}
    suite_props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert suite_props == {"dflash_verdict.toy.mul.fast": "accept"}
    # the report still has the measurements the flat properties came from
    report = json.loads((project.path / "dflash-report.json").read_text())
    speed = report["routes"]["toy.mul.fast"]["gates"]["speed"]["tests"][0]
    assert speed["measurements"]["ci_high"] == 0.92


TIMED = """
import pytest

@pytest.mark.gate("speed", family="toy.mul")
def test_speed(dflash_route, dflash_record, dflash_policy):
    from pytest_dflash.timing import speed_gate

    work = lambda: sum(i * i for i in range(3000))
    speed_gate(work, work, policy=dflash_policy, device="cpu", record=dflash_record,
               label="toy sum")
"""


def test_long_gate_shows_progress_but_not_under_q(pytester: pytest.Pytester,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_dflash import progress

    monkeypatch.setattr(progress, "DELAY_S", 0.0)  # show progress from the second round on
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_timed=TIMED)
    result = pytester.runpytest()
    # pytester output is not a TTY: plain lines, no carriage returns
    result.stdout.re_match_lines([r"dflash progress: test_speed\[toy\.mul\.fast\] toy sum: "
                                  r"\d+/12 rounds \(cap 48\), ratio \d+\.\d{3} "
                                  r"\[\d+\.\d{3}, \d+\.\d{3}\] so far, needs CI upper < 0\.990"])
    assert "\r" not in result.stdout.str()
    quiet = pytester.runpytest("-q")
    assert "dflash progress" not in quiet.stdout.str()


def test_xdist_workers_show_no_progress(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_w="""
        import os
        import pytest_dflash.progress as progress

        def test_worker_has_no_sink():
            assert os.environ.get("PYTEST_XDIST_WORKER")
            assert progress._SINK is None
    """)
    pytester.runpytest_subprocess("-n", "2", "-p", "xdist").assert_outcomes(passed=1)


BENCH = """
import pytest

@pytest.mark.gate("speed", family="toy.mul")
def test_paired(dflash_route, dflash_record):
    dflash_record(figure="paired ok")

@pytest.mark.gate("speed", family="toy.mul")
def test_twin(dflash_route, dflash_record, benchmark):
    benchmark.pedantic(lambda: sum(range(100)), rounds=2, iterations=1)
    dflash_record(figure="twin ran")

@pytest.mark.gate("parity", family="toy.mul")
def test_parity(dflash_route):
    pass
"""


@pytest.mark.parametrize(("flag", "outcomes", "speed"), [
    ([], {"passed": 3}, "passed"),
    (["--benchmark-skip"], {"passed": 2, "deselected": 1}, "passed"),
    (["--benchmark-disable"], {"passed": 3}, "passed"),
    (["--benchmark-only"], {"passed": 1, "skipped": 2}, "pending"),
])
def test_benchmark_flags_never_leave_a_ran_speed_gate_pending(
        pytester: pytest.Pytester, flag: list[str], outcomes: dict[str, int], speed: str) -> None:
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_bench=BENCH)
    result = pytester.runpytest(*flag)
    result.assert_outcomes(**outcomes)
    report = json.loads(Path(pytester.path, "dflash-report.json").read_text())
    assert report["routes"]["toy.mul.fast"]["gates"]["speed"]["status"] == speed
