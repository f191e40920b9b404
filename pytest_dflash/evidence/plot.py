"""Pictures of the evidence in a report: ``pytest-dflash plot REPORT [-o DIR]``.

Why: the report keeps raw samples and per-case errors, but a table shows only the deciding
figure. A reviewer judging a speed verdict wants to see the per-round ratios against the CI and
the threshold (drift, outliers, bimodal rounds); a parity verdict, how far every case stayed from
its bound; a quality verdict, which tasks flipped between baseline and candidate.

One PNG and one SVG per picture:

* speed and validation_cost: for each test, one panel per timed comparison (a validation_cost
  test has one per verify width): the per-round ratio candidate/baseline, the median, its CI
  band and the threshold;
* parity: for each route, every case of every parity test as error / bound (max abs error
  against the bound, relative L2 against its limit), 1 being the bound;
* quality: for each test, the per-task outcome grid, baseline row over candidate row.

matplotlib is an optional extra (``pip install 'pytest-dflash[plot]'``); it is imported only here,
and without pyplot (no global backend state is touched).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PASS_COLOR, FAIL_COLOR, NEUTRAL_COLOR = "#2e7d32", "#c62828", "#616161"
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


def timing_series(measurements: dict[str, Any], prefix: str = "",
                  ) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every paired timing comparison recorded in a test's measurements, with a label.

    A comparison is a mapping holding raw ``samples`` (candidate and baseline lists) and a
    ``threshold``; it may sit at the top (speed tests) or nested (validation_cost: one per M).
    """
    samples = measurements.get("samples")
    if (isinstance(samples, dict) and isinstance(samples.get("candidate"), list)
            and isinstance(samples.get("baseline"), list)
            and isinstance(measurements.get("threshold"), (int, float))):
        width = re.fullmatch(r"per_m m(\d+)", prefix)
        label = f"verify M={width.group(1)}" if width else prefix
        tokens = measurements.get("prompt_tokens")
        yield (label or measurements.get("shape")
               or (f"prompt of {tokens} tokens" if tokens else "timing")), measurements
    for key, value in measurements.items():
        if isinstance(value, dict) and key != "samples":
            yield from timing_series(value, f"{prefix} {key}".strip())


def _ratios(series: dict[str, Any]) -> list[float]:
    cand, base = series["samples"]["candidate"], series["samples"]["baseline"]
    return [c / b for c, b in zip(cand, base, strict=False) if b]


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


def plot_timing(route: str, kind: str, test: dict[str, Any], out: Path) -> list[Path]:
    """Per-round paired ratios with median, CI band and threshold, one panel per comparison."""
    series = [(label, s) for label, s in timing_series(test.get("measurements", {}))
              if len(_ratios(s)) >= 1]
    if not series:
        return []
    Figure = _matplotlib()
    cols = min(len(series), 4 if len(series) > 4 else len(series))
    rows = math.ceil(len(series) / cols)
    fig = Figure(figsize=(max(4.2 * cols, 6.4), 3.0 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(series):]:
        ax.set_visible(False)
    for ax, (label, s) in zip(axes.flat, series, strict=False):
        ratios = _ratios(s)
        rounds = range(1, len(ratios) + 1)
        size = 18 if len(ratios) <= 100 else 4
        ax.scatter(rounds, ratios, s=size, color="#1565c0", alpha=0.7, linewidths=0,
                   label="round ratio", zorder=3)
        lo, hi, med = s.get("ci_low"), s.get("ci_high"), s.get("ratio_median")
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
            ax.axhspan(lo, hi, color="#ffb300", alpha=0.35, zorder=1,
                       label=f"CI [{lo:.3f}, {hi:.3f}]")
        if isinstance(med, (int, float)):
            ax.axhline(med, color="#e65100", lw=1.5, zorder=4, label=f"median {med:.3f}")
        threshold = s["threshold"]
        op = "<" if s.get("rule", "gain") == "gain" else "<="
        ax.axhline(threshold, color=FAIL_COLOR, lw=1.2, ls="--", zorder=4,
                   label=f"threshold: CI upper {op} {threshold:.3f}")
        ax.axhline(1.0, color=NEUTRAL_COLOR, lw=0.8, ls=":", zorder=2)
        decided = s.get("outcome") or ""
        ok = s.get("passed")
        if ok is None and isinstance(hi, (int, float)):
            ok = hi < threshold if op == "<" else hi <= threshold
        ax.set_title(f"{label}\n{decided} ({'pass' if ok else 'FAIL'})", fontsize=9,
                     color=PASS_COLOR if ok else FAIL_COLOR)
        ax.set_xlabel("round", fontsize=8)
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
            if kind in ("speed", "validation_cost"):
                for test in tests:
                    written += plot_timing(route, kind, test, out)
            elif kind == "parity":
                written += plot_parity(route, tests, out)
            elif kind == "quality":
                for test in tests:
                    written += plot_quality(route, test, out)
    return written
