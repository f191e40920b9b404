"""History, comparison, progress, JUnit properties and pytest-benchmark flags in real pytest runs
(pytester), on a toy route family whose gates pass or fail as a file says."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TOY = """
from pytest_dflash import Family, Route
def pytest_dflash_routes(registry):
    registry.declare(Family("toy.mul", None, baseline="toy.mul.base", gates=("parity", "speed")))
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
def test_speed(dflash_gate):
    from pytest_dflash.measure.timing import speed_gate

    work = lambda: sum(i * i for i in range(3000))
    speed_gate(work, work, policy=dflash_gate.policy, device="cpu", record=dflash_gate.record,
               label="toy sum", timing=dflash_gate.timing)
"""


def test_long_gate_shows_progress_but_not_under_q(pytester: pytest.Pytester,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_dflash.measure import progress
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
        import pytest_dflash.measure.progress as progress

        def test_worker_has_no_sink(pytestconfig):
            assert os.environ.get("PYTEST_XDIST_WORKER")
            assert progress.sinks_of(pytestconfig) == ()
    """)
    pytester.runpytest_subprocess("-n", "2", "-p", "xdist").assert_outcomes(passed=1)


STAMPED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (.*)")


def _log(path: Path) -> list[str]:
    """The lines of a progress log without their UTC time stamps (each line must have one)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    texts = [STAMPED.fullmatch(line) for line in lines]
    assert all(texts), lines
    return [t.group(1) for t in texts]


def test_progress_log_records_a_long_gate_even_under_q(pytester: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_dflash.measure import progress
    monkeypatch.setattr(progress, "DELAY_S", 0.0)  # show progress from the second round on
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_timed=TIMED)
    result = pytester.runpytest("-q", "--dflash-progress-log", "logs/progress")
    assert "dflash progress" not in result.stdout.str()  # the terminal rules are unchanged
    logs = pytester.path / "logs" / "progress"  # relative to the rootdir, created
    assert sorted(p.name for p in logs.iterdir()) == ["main.log"]
    lines = _log(logs / "main.log")
    assert lines[0].startswith("session start, pid ")
    test = "test_timed.py::test_speed[toy.mul.fast] toy sum: "
    assert re.fullmatch(re.escape(test) + r"\d+/12 rounds \(cap 48\), ratio \d+\.\d{3} "
                        r"\[\d+\.\d{3}, \d+\.\d{3}\] so far, needs CI upper < 0\.990",
                        lines[1]), lines
    end = re.fullmatch(re.escape(test) + r"ended after (\d+) rounds \(target \d+, cap 48\) "
                       r"in \d+\.\d s", lines[-1])
    assert end, lines
    report = json.loads((pytester.path / "dflash-report.json").read_text())
    speed = report["routes"]["toy.mul.fast"]["gates"]["speed"]["tests"][0]
    assert int(end.group(1)) == speed["measurements"]["rounds"]
    # a second session appends to the same file
    pytester.runpytest("-q", "--dflash-progress-log", "logs/progress")
    assert len(_log(logs / "main.log")) > len(lines)


FAKE_GATES = """
import os

import pytest
from pytest_dflash.measure import progress
@pytest.mark.parametrize("n", range(4))
def test_fake_long_gate(n, pytestconfig):
    now = [0.0]
    worker = os.environ["PYTEST_XDIST_WORKER"]
    with progress.gate(f"fake {worker}", rule="no_regression", threshold=1.01,
                       max_rounds=1536, confidence=0.95, delay_s=3.0,
                       sinks=progress.sinks_of(pytestconfig),
                       clock=lambda: now[0]) as on_round:
        assert on_round is not None
        for done in range(1, 101):  # one round a second on the fake clock
            now[0] = float(done)
            on_round(done, 768, [1.0] * done, [1.0] * done)
"""


def test_progress_log_has_one_file_per_xdist_worker(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_fake=FAKE_GATES)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist", "-q",
                                           "--dflash-progress-log", "logs")
    result.assert_outcomes(passed=4)
    logs = pytester.path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["gw0.log", "gw1.log", "main.log"]
    assert len(_log(logs / "main.log")) == 1  # the controller runs no gate
    gates = 0
    for worker in ("gw0", "gw1"):
        lines = _log(logs / f"{worker}.log")
        assert lines[0].startswith("session start, pid ")
        for line in lines[1:]:  # each worker's lines come from its own gates only
            assert re.match(r"test_fake\.py::test_fake_long_gate\[\d\] fake " + worker + ": ",
                            line), line
        # a line at the start of each gate, then every 30 s of its 100 s, then its end
        rounds = [line.split(": ", 1)[1].split(" rounds")[0] for line in lines[1:]]
        assert rounds == ["3/768", "33/768", "63/768", "93/768", "ended after 100"] * (
            len(rounds) // 5), lines
        gates += len(rounds) // 5
    assert gates == 4


def test_unwritable_progress_log_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_timed=TIMED)
    pytester.path.joinpath("blocker").write_text("a file, not a folder")
    result = pytester.runpytest("--dflash-progress-log", "blocker/logs")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--dflash-progress-log blocker/logs: cannot write "
                                 f"{pytester.path / 'blocker' / 'logs' / 'main.log'} (*); give a "
                                 "directory that can be created and written, or leave the "
                                 "option out*"])


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
