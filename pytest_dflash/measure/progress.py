"""Live progress of long timing gates: rounds done, the running ratio and its CI.

Why: a validation_cost gate may take 1536 paired rounds at each of 8 verify widths; without a
sign of life a user cannot tell a working gate from a hung one, nor see where it is heading.
:func:`gate` wraps one paired comparison; after ``delay_s`` it reports through the sinks that the
plugin installed for the session, each at most every ``interval_s``, and tells them when it ends.

Terminal rules: nothing under ``-q``; on a TTY one line rewritten in place and erased when the
gate ends; when output is not a TTY (CI logs) a plain line every 30 s, never carriage returns;
nothing inside xdist workers (their output is not shown). Because GPU workers do run timing gates,
``--dflash-progress-log DIR`` adds a second sink, :class:`FileSink`: every process (``main``, or
the xdist worker id such as ``gw0``) appends time-stamped lines to ``DIR/<name>.log``, under
``-q`` too, so a slow gate in a worker can be watched with ``tail -f``. Each sink is throttled on
its own interval: a TTY line twice a second and a log line every 30 s need not agree.
The running CI is a plain bootstrap CI at the policy's confidence over the rounds so far; the
decision itself is taken by
:func:`pytest_dflash.measure.round_statistics.paired_compare` at its planned
looks.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import pytest

OnRound = Callable[[int, int, Sequence[float], Sequence[float]], None]


class Sink(Protocol):
    """Where progress goes: ``update`` shows a gate's current state (at most every
    ``interval_s``), ``end`` says the gate is over (only to a sink that was given an update)."""

    interval_s: float

    def update(self, label: str, status: str) -> None: ...

    def end(self, label: str, status: str) -> None: ...


SINKS = pytest.StashKey[tuple[Sink, ...]]()  # the session's sinks, set by install_for
DELAY_S = 3.0  # a gate shows progress only once it has run this long


def sinks_of(config: pytest.Config) -> tuple[Sink, ...]:
    """The sinks that show this session's progress (none: no progress is shown)."""
    return config.stash.get(SINKS, ())


class _Tracker:
    """The ``on_round`` callback of one gate: throttles each sink, computes the running CI
    (once per round that some sink is due for), reports, and tells the sinks it showed when the
    gate ends."""

    def __init__(self, sinks: Sequence[Sink], label: str, *, rule: str, threshold: float,
                 max_rounds: int, confidence: float, delay_s: float,
                 clock: Callable[[], float]) -> None:
        self.sinks, self.label, self.rule = sinks, label, rule
        self.threshold, self.max_rounds, self.confidence = threshold, max_rounds, confidence
        self.delay_s, self.clock = delay_s, clock
        self.start = clock()
        self.last: dict[int, float] = {}  # index of a sink -> when it was last updated
        self.done = self.target = 0

    def status(self, done: int, target: int, cand: Sequence[float],
               base: Sequence[float]) -> str:
        import numpy as np

        from pytest_dflash.measure.round_statistics import bootstrap_ci

        op = "<" if self.rule == "gain" else "<="
        ratios = np.asarray(cand[:done], dtype=float) / np.asarray(base[:done], dtype=float)
        median, lo, hi = bootstrap_ci(ratios, confidence=self.confidence, resamples=1000,
                                      seed=[done, 7])
        return (f"{done}/{target} rounds (cap {self.max_rounds}), ratio {median:.3f} "
                f"[{lo:.3f}, {hi:.3f}] so far, needs CI upper {op} {self.threshold:.3f}")

    def __call__(self, done: int, target: int, cand: Sequence[float],
                 base: Sequence[float]) -> None:
        self.done, self.target = done, target
        now = self.clock()
        if done < 2 or now - self.start < self.delay_s:  # a ratio's CI needs two rounds
            return
        due = [i for i, sink in enumerate(self.sinks)
               if i not in self.last or now - self.last[i] >= sink.interval_s]
        if not due:
            return
        status = self.status(done, target, cand, base)
        for i in due:
            self.last[i] = now
            self.sinks[i].update(self.label, status)

    def end(self) -> None:
        """The gate is over: an end line with its rounds, to each sink that showed it."""
        status = (f"ended after {self.done} rounds (target {self.target}, cap "
                  f"{self.max_rounds}) in {self.clock() - self.start:.1f} s")
        for i in self.last:
            self.sinks[i].end(self.label, status)


@contextmanager
def gate(label: str, *, rule: str, threshold: float, max_rounds: int, confidence: float,
         sinks: Sequence[Sink] = (), delay_s: float | None = None,
         clock: Callable[[], float] = time.monotonic) -> Iterator[OnRound | None]:
    """The ``on_round`` callback for one paired comparison, reporting to ``sinks`` (the
    session's: :func:`sinks_of`), or ``None`` when nobody listens."""
    if not sinks:
        yield None
        return
    tracker = _Tracker(sinks, label, rule=rule, threshold=threshold, max_rounds=max_rounds,
                       confidence=confidence, delay_s=DELAY_S if delay_s is None else delay_s,
                       clock=clock)
    try:
        yield tracker
    finally:
        tracker.end()


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

    def end(self, label: str, status: str) -> None:
        """Erase the TTY line; a plain log gets no end line (its last line stays the latest)."""
        if not (self.tty and self.active):
            return
        with self._suspended():
            self.reporter.rewrite("", erase=True)
            self.reporter.write("\r")
            self.reporter.flush()
        self.active = False


class FileSink:
    """Progress appended to ``<dir>/<name>.log``, one file per process of the session.

    Why: xdist workers (one GPU each) run timing gates but show nothing on the terminal; a file
    per process can be followed while the gate runs and read after it. A file is opened per line
    (a line every 30 s at most), so every line is on disk at once and nothing is held open. An
    error while writing never reaches the gate (it would decide the gate's outcome): the sink
    says so once on the real stderr and stops.
    """

    interval_s = 30.0

    def __init__(self, path: Path) -> None:
        self.path = path
        self.test = ""
        self.broken = False

    @classmethod
    def start(cls, directory: Path, name: str) -> FileSink:
        """Create ``directory`` if needed and write the first line of ``<name>.log`` (it shows
        when the process started, and proves at session start that the file is writable).
        Raises ``OSError``."""
        directory.mkdir(parents=True, exist_ok=True)
        sink = cls(directory / f"{name}.log")
        sink._append(f"session start, pid {os.getpid()}")
        return sink

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        """Remember which test runs: a line names it by its full node id."""
        self.test = nodeid

    def update(self, label: str, status: str) -> None:
        self._write(label, status)

    def end(self, label: str, status: str) -> None:
        self._write(label, status)

    def _write(self, label: str, status: str) -> None:
        if self.broken:
            return
        where = f"{self.test} " if self.test else ""
        try:
            self._append(f"{where}{label}: {status}")
        except OSError as exc:
            self.broken = True
            print(f"dflash: progress log {self.path}: {exc}; no more lines are written to it",
                  file=sys.__stderr__, flush=True)

    def _append(self, text: str) -> None:
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self.path.open("a", encoding="utf-8") as log:
            log.write(f"{stamp} {text}\n")


def _file_sink(config: pytest.Config, value: str | Path | None) -> FileSink | None:
    """The ``--dflash-progress-log`` sink of this process (``main``, or the xdist worker id),
    or None without the option. An unusable directory is a usage error here, at start."""
    if value is None:
        return None
    directory = Path(value)
    if not directory.is_absolute():
        directory = config.rootpath / directory
    name = config.workerinput["workerid"] if hasattr(config, "workerinput") else "main"
    try:
        return FileSink.start(directory, name)
    except OSError as exc:
        raise pytest.UsageError(
            f"--dflash-progress-log {value}: cannot write {directory / f'{name}.log'} ({exc}); "
            "give a directory that can be created and written, or leave the option out"
        ) from None


def install_for(config: pytest.Config, progress_log: str | Path | None) -> None:
    """Show progress in this pytest session where it should be shown: in the log file of
    ``--dflash-progress-log`` (``progress_log``, from the settings) from now on (every process),
    and on the terminal from session start (when pytest's terminal reporter exists: it is
    configured after this plugin; never in an xdist worker)."""
    log = _file_sink(config, progress_log)
    sinks: tuple[Sink, ...] = ()
    if log is not None:
        config.pluginmanager.register(log, "dflash-progress-log")
        sinks = (log,)
    config.stash[SINKS] = sinks
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Installer(config, sinks), "dflash-progress-installer")


class _Installer:
    def __init__(self, config: pytest.Config, sinks: tuple[Sink, ...]) -> None:
        self.config, self.sinks = config, sinks

    def pytest_sessionstart(self, session: Any) -> None:
        config = self.config
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or config.get_verbosity() < 0:
            return
        capture = config.pluginmanager.get_plugin("capturemanager")
        sink = TerminalSink(reporter, capture, tty=bool(getattr(reporter, "isatty", False)))
        config.pluginmanager.register(sink, "dflash-progress")
        config.stash[SINKS] = (sink, *self.sinks)
