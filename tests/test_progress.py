"""Progress of long timing gates: the tracker, the paired loop's callback, the terminal sink."""

from __future__ import annotations

import io
import re

import pytest

from pytest_dflash import progress
from pytest_dflash.statistics import paired_compare


class Recorder:
    """A sink that keeps what it was given (the terminal sink is tested on its own below)."""

    interval_s = 1.0

    def __init__(self) -> None:
        self.updates: list[str] = []
        self.cleared = 0

    def update(self, label: str, status: str) -> None:
        self.updates.append(f"{label}: {status}")

    def clear(self) -> None:
        self.cleared += 1


@pytest.fixture
def recorder() -> Recorder:
    sink = Recorder()
    progress.install(sink)
    yield sink
    progress.install(None)


def test_tracker_waits_throttles_and_reports_ratio_and_ci(recorder: Recorder) -> None:
    now = [0.0]
    cand = [1.0, 0.9, 0.95, 0.92, 0.91, 0.93]
    base = [1.0] * 6
    with progress.gate("gate_up M=64", rule="gain", threshold=0.99, max_rounds=48,
                       confidence=0.95, delay_s=3.0, clock=lambda: now[0]) as on_round:
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
    assert len(recorder.updates) == 2 and recorder.cleared == 1
    text = recorder.updates[0]
    match = re.fullmatch(r"gate_up M=64: 5/12 rounds \(cap 48\), ratio (\S+) \[(\S+), (\S+)\] "
                         r"so far, needs CI upper < 0\.990", text)
    assert match, text
    median, lo, hi = map(float, match.groups())
    assert median == pytest.approx(0.92) and lo <= median <= hi and lo >= 0.9 and hi <= 1.0


def test_no_sink_means_no_callback_and_a_silent_gate_is_not_cleared(recorder: Recorder) -> None:
    with progress.gate("quick", rule="no_regression", threshold=1.01, max_rounds=1536,
                       confidence=0.95, delay_s=100.0) as on_round:
        on_round(3, 12, [1.0] * 3, [1.0] * 3)
    assert recorder.updates == [] and recorder.cleared == 0
    progress.install(None)
    with progress.gate("quick", rule="gain", threshold=0.99, max_rounds=48,
                       confidence=0.95) as on_round:
        assert on_round is None


def test_paired_loop_reports_every_round() -> None:
    seen: list[tuple[int, int, int]] = []
    clock = iter(range(1, 10_000))

    def run() -> float:
        return 1e-3 * (1 + (next(clock) % 5) / 100)

    result = paired_compare(run, run, rounds=4, max_rounds=8, confidence=0.95, resamples=200,
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
    sink.clear()
    text = out.getvalue()
    assert "\rdflash 12/48 rounds | test_speed[r.fast] M=3" in text
    assert "\rdflash 24/48 rounds | test_speed[r.fast] M=3" in text
    assert text.endswith("\r") and "\n" not in text.split("24/48 rounds")[1]
    assert sink.interval_s < 1


def test_terminal_sink_writes_plain_lines_when_not_a_tty(pytester: pytest.Pytester) -> None:
    out = io.StringIO()
    sink = progress.TerminalSink(_reporter(pytester, out), None, tty=False)
    sink.update("M=3", "12/48 rounds")
    sink.clear()
    assert out.getvalue() == "dflash progress: M=3: 12/48 rounds\n"
    assert sink.interval_s >= 30
