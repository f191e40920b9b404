"""Session glue for history and comparison: ``--dflash-save`` and ``--dflash-compare``, and the
pytest-benchmark flags that would otherwise leave a speed gate pending.

The evidence collector calls these at fixed points (options, collection, session finish,
terminal summary); the work itself is done by :mod:`pytest_dflash.evidence.history`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_dflash import settings


def check_options(config: pytest.Config) -> None:
    """Bad save names are usage errors at the start, not surprises at the end of a long run."""
    from pytest_dflash.evidence.history import HistoryError, check_name

    name = settings.of(config).save
    if name:
        try:
            check_name(name)
        except HistoryError as exc:
            raise pytest.UsageError(str(exc)) from None


def deselect_skipped_benchmarks(config: pytest.Config, items: list[pytest.Item],
                                is_gate: Any) -> None:
    """Under ``--benchmark-skip``, gate tests built on pytest-benchmark's fixture are deselected.

    pytest-benchmark marks them skipped, and a skipped test keeps its gate pending. These tests
    are twins of the paired gate test (for ``--benchmark-json``); the gate is decided by the
    paired test, so without them the gate is decided by what did run, instead of staying
    pending. ``--benchmark-only`` is left alone: it skips the paired tests, and then the gate is
    rightly pending.
    """
    asked = settings.of(config)
    if not asked.benchmark_skip or asked.benchmark_only:
        return
    drop = [item for item in items
            if is_gate(item) and "benchmark" in getattr(item, "fixturenames", ())]
    if drop:
        config.hook.pytest_deselected(items=drop)
        dropped = set(map(id, drop))
        items[:] = [item for item in items if id(item) not in dropped]


class Comparison:
    """What the session did with history: where it saved, what it compared, the lines."""

    def __init__(self) -> None:
        self.saved: Path | None = None
        self.reference: Path | None = None
        self.lines: list[str] = []
        self.problems: list[str] = []


def finish(config: pytest.Config, evidence: dict[str, Any]) -> Comparison:
    """Compare first (with the previous run), then save; errors become problems, not crashes."""
    from pytest_dflash.evidence import history
    from pytest_dflash.evidence import report as reports
    done = Comparison()
    root = config.rootpath
    asked = settings.of(config)
    ref = asked.compare
    if ref is not None:
        try:
            done.reference = history.resolve(ref, root)
            result = history.compare(reports.load(done.reference), evidence)
            done.lines = result.lines()
        except reports.ReportError as exc:
            done.problems.append(f"--dflash-compare: {exc}")
    name = asked.save
    if name is not None:
        try:
            done.saved = history.save(evidence, root, name or None)
        except (reports.ReportError, OSError) as exc:
            done.problems.append(f"--dflash-save: {exc}")
    return done


def summary_lines(done: Comparison, root: Path) -> list[tuple[str, dict[str, bool]]]:
    """Lines for the terminal summary, with their markup."""
    out: list[tuple[str, dict[str, bool]]] = []
    if done.reference is not None:
        out.append((f"compared with {_rel(done.reference, root)}:", {"bold": True}))
        for line in done.lines:
            worse = line.endswith("<- worse") or line.startswith(("got worse", "NOT LIKE"))
            out.append((f"  {line}", {"red": True} if worse else {}))
    if done.saved is not None:
        out.append((f"saved as {_rel(done.saved, root)}", {}))
    return out


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)
