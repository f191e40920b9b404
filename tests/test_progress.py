"""Progress of long timing gates: the tracker, the paired loop's callback, the terminal sink."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from pytest_dflash.measure import progress
from pytest_dflash.measure.round_statistics import paired_compare, sides


class Recorder:
    """A sink that keeps what it was given (the terminal sink is tested on its own below)."""

    interval_s = 1.0

    def __init__(self) -> None:
        self.updates: list[str] = []
        self.ends: list[str] = []

    def update(self, label: str, status: str) -> None:
        self.updates.append(f"{label}: {status}")

    def end(self, label: str, status: str) -> None:
        self.ends.append(f"{label}: {status}")


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def test_tracker_waits_throttles_and_reports_ratio_and_ci(recorder: Recorder) -> None:
    now = [0.0]
    cand = [1.0, 0.9, 0.95, 0.92, 0.91, 0.93]
    base = [1.0] * 6
    with progress.gate("gate_up M=64", rule="gain", threshold=0.99, max_rounds=48,
                       confidence=0.95, sinks=(recorder,), delay_s=3.0,
                       clock=lambda: now[0]) as on_round:
        assert on_round is not None
        now[0] = 2.0
        on_round(2, 12, cand, base)  # before the delay: silent
        assert recorder.updates == []
        now[0] = 3.5
        on_round(5, 12, cand, base)
        now[0] = 4.0
        on_round(6, 12, cand, base)  # within the interval: throttled
        now[0] = 4.6
        on_round(6, 12, cand, base)
    assert len(recorder.updates) == 2
    assert recorder.ends == ["gate_up M=64: ended after 6 rounds (target 12, cap 48) in 4.6 s"]
    text = recorder.updates[0]
    match = re.fullmatch(r"gate_up M=64: 5/12 rounds \(cap 48\), ratio (\S+) \[(\S+), (\S+)\] "
                         r"so far, needs CI upper < 0\.990", text)
    assert match, text
    median, lo, hi = map(float, match.groups())
    assert median == pytest.approx(0.92) and lo <= median <= hi and lo >= 0.9 and hi <= 1.0


def test_no_sink_means_no_callback_and_a_silent_gate_is_not_cleared(recorder: Recorder) -> None:
    with progress.gate("quick", rule="no_regression", threshold=1.01, max_rounds=1536,
                       confidence=0.95, sinks=(recorder,), delay_s=100.0) as on_round:
        on_round(3, 12, [1.0] * 3, [1.0] * 3)
    assert recorder.updates == [] and recorder.ends == []
    with progress.gate("quick", rule="gain", threshold=0.99, max_rounds=48,
                       confidence=0.95) as on_round:
        assert on_round is None


def test_paired_loop_reports_every_round() -> None:
    seen: list[tuple[int, int, int]] = []
    clock = iter(range(1, 10_000))

    def run() -> float:
        return 1e-3 * (1 + (next(clock) % 5) / 100)

    result = paired_compare(sides(run, run), rounds=4, max_rounds=8, confidence=0.95, resamples=200,
                            seed=1, rule="gain", threshold=0.99,
                            on_round=lambda done, target, c, b: seen.append((done, target,
                                                                             len(c))))
    assert [s[0] for s in seen] == list(range(1, result.rounds + 1))
    assert all(done == n for done, _, n in seen)
    assert seen[0][1] == 4 and seen[-1][1] == result.rounds


def _reporter(pytester: pytest.Pytester, out: io.StringIO):
    from _pytest.terminal import TerminalReporter

    config = pytester.parseconfig()
    reporter = TerminalReporter(config, out)
    return reporter


def test_terminal_sink_rewrites_one_line_on_a_tty(pytester: pytest.Pytester) -> None:
    out = io.StringIO()
    sink = progress.TerminalSink(_reporter(pytester, out), None, tty=True)
    sink.pytest_runtest_logstart("suites/t.py::test_speed[r.fast]", ("", 0, ""))
    sink.update("M=3", "12/48 rounds")
    sink.update("M=3", "24/48 rounds")
    sink.end("M=3", "ended after 24 rounds")
    text = out.getvalue()
    assert "\rdflash 12/48 rounds | test_speed[r.fast] M=3" in text
    assert "\rdflash 24/48 rounds | test_speed[r.fast] M=3" in text
    assert text.endswith("\r") and "\n" not in text.split("24/48 rounds")[1]
    assert sink.interval_s < 1


def test_terminal_sink_writes_plain_lines_when_not_a_tty(pytester: pytest.Pytester) -> None:
    out = io.StringIO()
    sink = progress.TerminalSink(_reporter(pytester, out), None, tty=False)
    sink.update("M=3", "12/48 rounds")
    sink.end("M=3", "ended after 12 rounds")
    assert out.getvalue() == "dflash progress: M=3: 12/48 rounds\n"
    assert sink.interval_s >= 30


class Throttled(Recorder):
    """A recorder with a long interval, next to the 1 s one: each sink is throttled alone."""

    interval_s = 30.0


def test_each_sink_is_throttled_on_its_own_interval_and_ended_only_if_shown() -> None:
    fast, slow = Recorder(), Throttled()
    now = [0.0]
    with progress.gate("M=1", rule="no_regression", threshold=1.01, max_rounds=1536,
                       confidence=0.95, sinks=(fast, slow), delay_s=3.0,
                       clock=lambda: now[0]) as on_round:
        for done in range(1, 41):  # one round a second
            now[0] = float(done)
            on_round(done, 768, [1.0] * done, [1.0] * done)
    with progress.gate("short", rule="gain", threshold=0.99, max_rounds=48, confidence=0.95,
                       sinks=(fast, slow), delay_s=3.0, clock=lambda: now[0]) as on_round:
        on_round(2, 12, [1.0] * 2, [1.0] * 2)  # ends before the delay: no lines at all
    assert [u.split(" rounds")[0] for u in fast.updates] == [f"M=1: {d}/768" for d in
                                                              range(3, 41)]
    assert [u.split(" rounds")[0] for u in slow.updates] == ["M=1: 3/768", "M=1: 33/768"]
    end = "M=1: ended after 40 rounds (target 768, cap 1536) in 40.0 s"
    assert fast.ends == [end] and slow.ends == [end]


LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (.*)")


def test_file_sink_appends_stamped_lines_naming_the_test(tmp_path: Path) -> None:
    sink = progress.FileSink.start(tmp_path / "new" / "logs", "gw1")
    sink.pytest_runtest_logstart("suites/t.py::test_speed[r.fast]", ("", 0, ""))
    sink.update("M=3", "12/48 rounds")
    sink.end("M=3", "ended after 20 rounds")
    lines = (tmp_path / "new" / "logs" / "gw1.log").read_text().splitlines()
    texts = [LINE.fullmatch(line).group(1) for line in lines]
    assert texts[0].startswith("session start, pid ")
    assert texts[1:] == ["suites/t.py::test_speed[r.fast] M=3: 12/48 rounds",
                         "suites/t.py::test_speed[r.fast] M=3: ended after 20 rounds"]
    assert sink.interval_s >= 30


def test_file_sink_that_cannot_write_stops_without_raising(tmp_path: Path,
                                                          capfd: pytest.CaptureFixture) -> None:
    sink = progress.FileSink.start(tmp_path, "main")
    sink.path.unlink()
    sink.path.mkdir()  # the log is now a directory: every append fails
    sink.update("M=3", "12/48 rounds")  # a gate must not fail because its log cannot be written
    sink.update("M=3", "24/48 rounds")
    err = capfd.readouterr().err
    assert err.count("dflash: progress log") == 1 and str(sink.path) in err
