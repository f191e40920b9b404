"""Live progress of long timing gates: rounds done, the running ratio and its CI.

Why: a validation_cost gate may take 1536 paired rounds at each of 8 verify widths; without a
sign of life a user cannot tell a working gate from a hung one, nor see where it is heading.
:func:`gate` wraps one paired comparison; after ``delay_s`` it reports through the sink that the
plugin installed for the session (pytest's terminal reporter), at most every ``interval_s``.

Output rules: nothing under ``-q``; on a TTY one line rewritten in place and erased when the gate
ends; when output is not a TTY (CI logs) a plain line every 30 s, never carriage returns; nothing
inside xdist workers (their output is not shown, and timing gates refuse to run there anyway).
The running CI is a plain bootstrap CI at the policy's confidence over the rounds so far; the
decision itself is taken by :func:`pytest_dflash.statistics.paired_compare` at its planned looks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

OnRound = Callable[[int, int, Sequence[float], Sequence[float]], None]


class Sink(Protocol):
    """Where progress goes: ``update`` shows a gate's current state, ``clear`` ends it."""

    interval_s: float

    def update(self, label: str, status: str) -> None: ...

    def clear(self) -> None: ...


_SINK: Sink | None = None
DELAY_S = 3.0  # a gate shows progress only once it has run this long


def install(sink: Sink | None) -> None:
    """Make ``sink`` receive the progress of every gate from now on (``None``: no progress)."""
    global _SINK
    _SINK = sink


class _Tracker:
    """The ``on_round`` callback of one gate: throttles, computes the running CI, reports."""

    def __init__(self, sink: Sink, label: str, *, rule: str, threshold: float, max_rounds: int,
                 confidence: float, delay_s: float, clock: Callable[[], float]) -> None:
        self.sink, self.label, self.rule = sink, label, rule
        self.threshold, self.max_rounds, self.confidence = threshold, max_rounds, confidence
        self.delay_s, self.clock = delay_s, clock
        self.start = clock()
        self.last: float | None = None
        self.shown = False

    def status(self, done: int, target: int, cand: Sequence[float],
               base: Sequence[float]) -> str:
        import numpy as np

        from pytest_dflash.statistics import bootstrap_ci

        op = "<" if self.rule == "gain" else "<="
        ratios = np.asarray(cand[:done], dtype=float) / np.asarray(base[:done], dtype=float)
        median, lo, hi = bootstrap_ci(ratios, confidence=self.confidence, resamples=1000,
                                      seed=[done, 7])
        return (f"{done}/{target} rounds (cap {self.max_rounds}), ratio {median:.3f} "
                f"[{lo:.3f}, {hi:.3f}] so far, needs CI upper {op} {self.threshold:.3f}")

    def __call__(self, done: int, target: int, cand: Sequence[float],
                 base: Sequence[float]) -> None:
        now = self.clock()
        if done < 2 or now - self.start < self.delay_s:  # a ratio's CI needs two rounds
            return
        if self.last is not None and now - self.last < self.sink.interval_s:
            return
        self.last = now
        self.shown = True
        self.sink.update(self.label, self.status(done, target, cand, base))


@contextmanager
def gate(label: str, *, rule: str, threshold: float, max_rounds: int, confidence: float,
         delay_s: float | None = None, clock: Callable[[], float] = time.monotonic,
         ) -> Iterator[OnRound | None]:
    """The ``on_round`` callback for one paired comparison, or ``None`` when nobody listens."""
    sink = _SINK
    if sink is None:
        yield None
        return
    tracker = _Tracker(sink, label, rule=rule, threshold=threshold, max_rounds=max_rounds,
                       confidence=confidence, delay_s=DELAY_S if delay_s is None else delay_s,
                       clock=clock)
    try:
        yield tracker
    finally:
        if tracker.shown:
            sink.clear()


class TerminalSink:
    """Progress through pytest's terminal reporter, with output capture suspended meanwhile
    (a gate runs inside a test call, where pytest captures stdout)."""

    def __init__(self, reporter: Any, capture: Any, *, tty: bool) -> None:
        self.reporter, self.capture, self.tty = reporter, capture, tty
        self.interval_s = 0.5 if tty else 30.0
        self.active = False
        self.test = ""

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        """Remember which test runs, so a progress line names it (route id included)."""
        self.test = nodeid.rpartition("::")[2]

    def _suspended(self) -> Any:
        if self.capture is None:
            from contextlib import nullcontext

            return nullcontext()
        return self.capture.global_and_fixture_disabled()

    def update(self, label: str, status: str) -> None:
        with self._suspended():
            where = f"{self.test} " if self.test else ""
            if not self.tty:
                self.reporter.write_line(f"dflash progress: {where}{label}: {status}")
                return
            if not self.active:
                self.reporter.ensure_newline()
                self.active = True
            width = max(20, self.reporter._tw.fullwidth - 1)
            line = f"dflash {status} | {where}{label}"  # numbers first: a narrow terminal
            # cuts the names, not the figures
            self.reporter.rewrite(line[:width], erase=True)
            self.reporter.flush()

    def clear(self) -> None:
        if not (self.tty and self.active):
            return
        with self._suspended():
            self.reporter.rewrite("", erase=True)
            self.reporter.write("\r")
            self.reporter.flush()
        self.active = False


def install_for(config: Any) -> None:
    """Show progress in this pytest session if it should be shown (decided at session start,
    when pytest's terminal reporter exists: it is configured after this plugin)."""
    if hasattr(config, "workerinput"):
        install(None)
        return
    config.pluginmanager.register(_Installer(config), "dflash-progress-installer")
    config.add_cleanup(lambda: install(None))


class _Installer:
    def __init__(self, config: Any) -> None:
        self.config = config

    def pytest_sessionstart(self, session: Any) -> None:
        config = self.config
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or config.get_verbosity() < 0:
            install(None)
            return
        capture = config.pluginmanager.get_plugin("capturemanager")
        sink = TerminalSink(reporter, capture, tty=bool(getattr(reporter, "isatty", False)))
        config.pluginmanager.register(sink, "dflash-progress")
        install(sink)
