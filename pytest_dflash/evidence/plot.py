"""Pictures of the evidence in a report: ``pytest-dflash plot REPORT [-o DIR]``.

Why: the report keeps raw samples and per-case errors, but a table shows only the deciding
figure. A reviewer judging a speed verdict wants to see the per-round ratios against the CI and
the threshold (drift, outliers, bimodal rounds); a parity verdict, how far every case stayed from
its bound; a quality verdict, which tasks flipped between baseline and candidate.

One PNG and one SVG per picture:

* speed, prefill and validation_cost: for each test, one panel per timed comparison (a
  validation_cost test has one per verify width): the interval band, the ratio and the
  threshold. Timed in worker processes (the usual case), each process's ratio (its statistic,
  the unit the interval is computed across) is a diamond and its rounds a strip beside it,
  with a line after each look, so a process that stood apart shows at once; timed in the
  test's own process, each round's ratio in order;
* parity: for each route, every case of every parity test as error / bound (max abs error
  against the bound, relative L2 against its limit), 1 being the bound;
* quality: for each test, the per-task outcome grid, baseline row over candidate row.

matplotlib is an optional extra (``pip install 'pytest-dflash[plot]'``); it is imported only here,
and without pyplot (no global backend state is touched).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_dflash.evidence import timings
from pytest_dflash.routes.vocabulary import EXCLUSIVE_KINDS as TIMING_KINDS

PASS_COLOR, FAIL_COLOR, NEUTRAL_COLOR = "#2e7d32", "#c62828", "#616161"
# a process's ratio (or a round's, timed in the test's process) and the rounds of a process
ROUND_COLOR, STRIP_COLOR = "#1565c0", "#64b5f6"
MAX_TASKS_PER_ROW = 50


class PlotError(RuntimeError):
    """Plotting is impossible here (matplotlib missing) or the output folder is unusable."""


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("pytest-dflash plot needs matplotlib; install the extra: "
                        "pip install 'pytest-dflash[plot]'") from None
    return Figure


def _slug(*parts: str) -> str:
    """A file stem from route, gate kind and test name: ``route__kind__test``."""
    return "__".join(re.sub(r"[^A-Za-z0-9.=-]+", "_", p).strip("_")[:80] for p in parts)


def _test_name(nodeid: str) -> str:
    return nodeid.rpartition("::")[2] or nodeid


def _outcome_color(outcome: str) -> str:
    return PASS_COLOR if outcome == "passed" else FAIL_COLOR if outcome in (
        "failed", "error") else NEUTRAL_COLOR


def _save(fig: Any, out: Path, stem: str) -> list[Path]:
    paths = []
    for ext in ("png", "svg"):
        path = out / f"{stem}.{ext}"
        fig.savefig(path, dpi=100 if ext == "png" else None, bbox_inches="tight")
        paths.append(path)
    return paths


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _limits(values: list[float], rounds: list[float]) -> tuple[float, float]:
    """A y range that shows every decision line and process ratio and the bulk of the rounds:
    a preempted round at 3x the others would otherwise squash the interval to a line."""
    import numpy as np

    shown = list(values)
    if rounds:
        shown += [float(np.quantile(rounds, 0.02)), float(np.quantile(rounds, 0.98))]
    low, high = min(shown), max(shown)
    pad = max(high - low, 1e-3) * 0.08
    return low - pad, high + pad


def _decision_lines(ax: Any, s: Mapping[str, Any]) -> tuple[bool, str]:
    """Interval band, ratio, threshold and the 1.0 line of one comparison; (passed, op)."""
    lo, hi, med = s.get("ci_low"), s.get("ci_high"), s.get("ratio_median")
    if _number(lo) and _number(hi):
        ax.axhspan(lo, hi, color="#ffb300", alpha=0.35, zorder=1,
                   label=f"interval [{lo:.3f}, {hi:.3f}]")
    if _number(med):
        name = "ratio" if timings.protocol(s) == timings.PROCESS else "median"
        ax.axhline(med, color="#e65100", lw=1.5, zorder=4, label=f"{name} {med:.3f}")
    threshold = s["threshold"]
    op = "<" if s.get("rule", "gain") == "gain" else "<="
    ax.axhline(threshold, color=FAIL_COLOR, lw=1.2, ls="--", zorder=4,
               label=f"threshold: upper {op} {threshold:.3f}")
    ax.axhline(1.0, color=NEUTRAL_COLOR, lw=0.8, ls=":", zorder=2)
    ok = s.get("passed")
    if ok is None and _number(hi):
        ok = hi < threshold if op == "<" else hi <= threshold
    return bool(ok), op


def _draw_rounds(ax: Any, s: Mapping[str, Any]) -> None:
    """Round protocol (timed in the test's own process): each round's ratio in order."""
    ratios = timings.ratios(s["samples"])
    rounds = range(1, len(ratios) + 1)
    size = 18 if len(ratios) <= 100 else 4
    ax.scatter(rounds, ratios, s=size, color=ROUND_COLOR, alpha=0.7, linewidths=0,
               label="round ratio", zorder=3)
    ax.set_xlabel("round", fontsize=8)


def _draw_processes(ax: Any, s: Mapping[str, Any]) -> None:
    """Process protocol: each worker's kept rounds as a strip at its x with a bar over the
    middle half of all its rounds, its statistic (the ratio the interval is computed from) as a
    diamond, and a line after each look's processes."""
    import numpy as np

    procs = timings.processes(s)
    stats = [p["ratio"] for p in procs if p["ratio"] is not None]
    every = [r for p in procs for r in p["rounds"]]
    lines = [v for v in (s.get("ci_low"), s.get("ci_high"), s.get("ratio_median"),
                         s["threshold"], 1.0) if _number(v)]
    low, high = _limits(stats + lines, every)
    for i, proc in enumerate(procs):
        if proc["quartiles"] is not None:  # the middle half of every round, not only the kept
            q1, q3 = np.clip(proc["quartiles"], low, high)
            ax.vlines(proc["index"], q1, q3, color=STRIP_COLOR, lw=2.5, zorder=2,
                      label="middle half of its rounds" if i == 0 else None)
        rounds = np.asarray(proc["rounds"], dtype=float)
        if rounds.size == 0:
            continue
        xs = proc["index"] + np.linspace(-0.28, 0.28, rounds.size)
        inside = (rounds >= low) & (rounds <= high)
        ax.scatter(xs[inside], rounds[inside], s=7, color=STRIP_COLOR, alpha=0.8,
                   linewidths=0, zorder=2, label="rounds of a process" if i == 0 else None)
        outside = ~inside
        if outside.any():  # kept in view at the edge, as triangles pointing off the axis
            ax.scatter(xs[outside], np.clip(rounds[outside], low, high), s=16,
                       marker="^" if rounds[outside].max() > high else "v",
                       color=STRIP_COLOR, zorder=2)
    xs = [p["index"] for p in procs if p["ratio"] is not None]
    ax.scatter(xs, stats, s=46, marker="D", color=ROUND_COLOR, edgecolors="white",
               linewidths=0.6, zorder=5, label="process ratio (its statistic)")
    looks = [n for n in s.get("looks") or [] if isinstance(n, int)]
    for k, n in enumerate(looks[:-1], start=1):
        ax.axvline(n + 0.5, color=NEUTRAL_COLOR, lw=0.9, ls="-.", zorder=1,
                   label="look" if k == 1 else None)
        ax.text(n + 0.5, high, f" look {k}", fontsize=6.5, va="top", color=NEUTRAL_COLOR)
    ax.set_ylim(low, high)
    ax.set_xticks(range(1, len(procs) + 1))
    ax.set_xlabel(f"worker process ({len(procs)}; looks at {', '.join(map(str, looks))})",
                  fontsize=8)


def plot_timing(route: str, kind: str, test: dict[str, Any], out: Path) -> list[Path]:
    """One panel per timed comparison (a validation_cost test has one per verify width): the
    interval, the ratio and the threshold over what was timed, per process or per round."""
    series = list(timings.comparisons(test.get("measurements", {})))
    if not series:
        return []
    Figure = _matplotlib()
    cols = min(len(series), 4)
    rows = math.ceil(len(series) / cols)
    fig = Figure(figsize=(max(4.2 * cols, 6.4), 3.0 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(series):]:
        ax.set_visible(False)
    for ax, (label, s) in zip(axes.flat, series, strict=False):
        if timings.protocol(s) == timings.PROCESS:
            _draw_processes(ax, s)
        else:
            _draw_rounds(ax, s)
        ok, _ = _decision_lines(ax, s)
        decided = s.get("decision") or ("pass" if ok else "not passed")
        words = s.get("outcome")  # faster / neutral / slower / inconclusive
        ax.set_title(f"{label}\n{decided}" + (f" ({words})" if words else ""), fontsize=9,
                     color=PASS_COLOR if ok else FAIL_COLOR)
        ax.set_ylabel("candidate / baseline time", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6.5, loc="best", framealpha=0.85)
    fig.suptitle(f"{route} {kind}: {_test_name(test['nodeid'])} ({test['outcome']})",
                 fontsize=10, color=_outcome_color(test["outcome"]))
    return _save(fig, out, _slug(route, kind, _test_name(test["nodeid"])))


def parity_points(tests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case of a parity gate as error/bound ratios, tagged with its test."""
    points = []
    for test in tests:
        for case in test.get("measurements", {}).get("cases", []) or []:
            if not isinstance(case, dict):
                continue
            abs_ratio = rel_ratio = None
            if isinstance(case.get("max_abs"), (int, float)) and case.get("bound"):
                abs_ratio = case["max_abs"] / case["bound"]
            if isinstance(case.get("rel_l2"), (int, float)) and case.get("rel_l2_limit"):
                rel_ratio = case["rel_l2"] / case["rel_l2_limit"]
            points.append({"test": _test_name(test["nodeid"]), "label": case.get("label", ""),
                           "ok": bool(case.get("ok", True)), "abs": abs_ratio, "rel": rel_ratio,
                           "nonfinite": case.get("nonfinite", 0)})
    return points


def plot_parity(route: str, tests: list[dict[str, Any]], out: Path) -> list[Path]:
    """All cases of a route's parity gate: max abs error / bound and rel L2 / limit."""
    points = parity_points(tests)
    if not points:
        return []
    Figure = _matplotlib()
    names = list(dict.fromkeys(p["test"] for p in points))
    fig = Figure(figsize=(max(7.0, min(16.0, 0.06 * len(points) + 5)), 6.2),
                 layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    cmap = fig.colormaps["tab20"] if hasattr(fig, "colormaps") else None
    if cmap is None:
        from matplotlib import colormaps

        cmap = colormaps["tab20"]
    for ax, key, title in ((axes[0], "abs", "max abs error / bound"),
                           (axes[1], "rel", "relative L2 / limit")):
        # exact results (error 0) have no place on a log axis: drawn as triangles at its foot
        positive = [p[key] for p in points if p[key] is not None and p[key] > 0]
        floor = min(positive) / 10 if positive else 1e-3
        for index, name in enumerate(names):
            xs = [i for i, p in enumerate(points) if p["test"] == name and p[key]]
            ax.scatter(xs, [points[i][key] for i in xs], s=14, color=cmap(index % 20),
                       label=name, zorder=3)
        zeros = [i for i, p in enumerate(points) if p[key] == 0]
        if zeros:
            ax.scatter(zeros, [floor] * len(zeros), s=22, marker="v", color=NEUTRAL_COLOR,
                       zorder=3, label="exactly 0")
        bad = [i for i, p in enumerate(points) if not p["ok"] and p[key] is not None]
        if bad:
            ax.scatter(bad, [max(points[i][key], floor) for i in bad], s=60, facecolors="none",
                       edgecolors=FAIL_COLOR, linewidths=1.5, zorder=4, label="failed case")
        ax.axhline(1.0, color=FAIL_COLOR, ls="--", lw=1.2, label="bound", zorder=2)
        ax.set_yscale("log")
        ax.set_ylabel(title, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3, which="major")
    axes[1].set_xlabel("case (grouped by test)", fontsize=8)
    axes[0].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    worst = max((p["abs"] or 0.0) for p in points)
    failed = sum(not p["ok"] for p in points)
    status = "all within bound" if not failed else f"{failed} case(s) FAILED"
    fig.suptitle(f"{route} parity: {len(points)} cases in {len(names)} tests, {status}; "
                 f"worst max-abs/bound {worst:.2g}", fontsize=10,
                 color=PASS_COLOR if not failed else FAIL_COLOR)
    return _save(fig, out, _slug(route, "parity"))


def plot_quality(route: str, test: dict[str, Any], out: Path) -> list[Path]:
    """Per-task outcome grid: baseline row over candidate row, discordant tasks marked."""
    per_task = test.get("measurements", {}).get("per_task")
    if not isinstance(per_task, list) or not per_task:
        return []
    Figure = _matplotlib()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    n = len(per_task)
    width = min(n, MAX_TASKS_PER_ROW)
    blocks = math.ceil(n / width)
    fig = Figure(figsize=(max(6.0, 0.2 * width + 2.5), 1.3 * blocks + 1.3),
                 layout="constrained")
    axes = fig.subplots(blocks, 1, squeeze=False)[:, 0]
    cmap = ListedColormap(["#ef9a9a", "#a5d6a7"])  # fail, pass
    for block, ax in enumerate(axes):
        chunk = per_task[block * width:(block + 1) * width]
        grid = [[float(t[side]["passed"]) for t in chunk] for side in ("baseline", "candidate")]
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_xlim(-0.5, width - 0.5)  # equal cells in every block, the last one too
        ax.axhline(0.5, color="white", lw=2)
        for col, task in enumerate(chunk):
            if task["baseline"]["passed"] != task["candidate"]["passed"]:
                ax.add_patch(_rect(col, task["candidate"]["passed"]))
            for row, side in enumerate(("baseline", "candidate")):
                if not task[side].get("contract_ok", True):
                    ax.text(col, row, "x", ha="center", va="center", fontsize=7)
        ax.set_yticks([0, 1], ["baseline", "candidate"], fontsize=8)
        start = block * width
        step = 5 if width > 20 else 1
        ax.set_xticks(range(0, len(chunk), step), [str(start + i) for i in
                                                   range(0, len(chunk), step)], fontsize=7)
        ax.set_xticks([x - 0.5 for x in range(len(chunk) + 1)], minor=True)
        ax.grid(which="minor", axis="x", color="white", lw=0.8)
        ax.tick_params(which="minor", length=0)
    axes[-1].set_xlabel("task index", fontsize=8)
    m = test["measurements"]
    legend = [Patch(color="#a5d6a7", label="passed"), Patch(color="#ef9a9a", label="failed"),
              Patch(facecolor="none", edgecolor="#1565c0", label="candidate better"),
              Patch(facecolor="none", edgecolor=FAIL_COLOR, label="candidate worse")]
    fig.legend(handles=legend, loc="outside lower center", ncols=4, fontsize=7, frameon=False)
    fig.suptitle(f"{route} quality: {n} tasks, pass@1 {m.get('pass_at_1_baseline', 0):.2f} -> "
                 f"{m.get('pass_at_1_candidate', 0):.2f}, McNemar p="
                 f"{m.get('mcnemar_p_regression', float('nan')):.2g} ({test['outcome']}); "
                 "x = output-contract violation", fontsize=9,
                 color=_outcome_color(test["outcome"]))
    return _save(fig, out, _slug(route, "quality", _test_name(test["nodeid"])))


def _rect(col: int, candidate_passed: bool) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((col - 0.5, -0.5), 1, 2, fill=False, lw=2,
                     edgecolor="#1565c0" if candidate_passed else FAIL_COLOR)


def plot_report(report: dict[str, Any], out: Path) -> list[Path]:
    """Every picture the report supports, written under ``out``; the paths written."""
    _matplotlib()
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlotError(f"cannot create output folder {out}: {exc}") from None
    written: list[Path] = []
    for route, entry in sorted(report["routes"].items()):
        for kind, gate in entry["gates"].items():
            tests = gate.get("tests", [])
            if kind in TIMING_KINDS:  # speed, prefill, validation_cost
                for test in tests:
                    written += plot_timing(route, kind, test, out)
            elif kind == "parity":
                written += plot_parity(route, tests, out)
            elif kind == "quality":
                for test in tests:
                    written += plot_quality(route, test, out)
    return written
