"""``pytest-dflash selftest --repeat K``: the timing gates' error rates, measured here.

One self-test run shows whether each gate caught its planted defects once. Whether a timing gate
can be trusted is a rate: how often its unchanged copy (an A/A control: the route's very own
calls) passes, is inconclusive or fails, and how often planted slowdowns of 1%, 2%, 5% and 10%
do. This runs the calibration self-test (``--dflash-selftest --dflash-selftest-calibrate``, the
timing gates only) K times, each run its own pytest process with its own timing workers, and
counts the outcomes per route, gate and planted route. The table is printed and written into
the last run's report (``selftest_repeat``) and to a JSON file of its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_dflash.evidence.catch import COPY
from pytest_dflash.routes.vocabulary import EXCLUSIVE_KINDS as TIMING_KINDS
from pytest_dflash.selftest import child

OUTCOMES = ("pass", "inconclusive", "fail", "error", "pending")


class RepeatError(RuntimeError):
    """A run of the repeat that pytest ended without results: what happened and the fix."""


# pytest's exit codes a run can end with besides 0, 1 (a gate failed) and 2 (interrupted)
_WHY = {
    3: "pytest hit an internal error (its traceback is printed above); fix what it names and "
       "repeat",
    4: "pytest refused the command line (the usage error is printed above); fix the arguments "
       "after --run",
    5: "it selected no test: -k, -m and --dflash-route leave no timing gate test of a route "
       "that requires that gate (the verdict table shows '-' for a gate a route does not "
       "require); select a timing gate the route requires, or another route",
}


def gate_result(gate: Mapping[str, Any] | None) -> str:
    """One gate of one run as pass / inconclusive / fail / error / pending."""
    if gate is None:
        return "pending"
    outcomes = [t["outcome"] for t in gate.get("tests", [])]
    if "error" in outcomes:
        return "error"
    if "failed" in outcomes:
        return "fail"
    if "inconclusive" in outcomes:
        return "inconclusive"
    if outcomes and all(o == "passed" for o in outcomes):
        return "pass"
    return "pending"


def tally(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts per original route, timing gate kind and planted key ("route" = the route
    itself, "copy", "slow_2pct", ...) over the runs' reports.

    A gate with no test in a run (deselected by ``-k``, or not run at all) is not an outcome
    of that run: it is left out of the counts, so each row's total says how many runs it was
    measured in. A gate whose tests ran but were skipped counts as pending."""
    counts: dict[str, Any] = {}
    for report in reports:
        for name, entry in report.get("routes", {}).items():
            planted = entry.get("planted")
            original = planted["from"] if planted else name
            key = planted["defect"] if planted else "route"
            for kind in TIMING_KINDS:
                gate = entry.get("gates", {}).get(kind)
                if kind not in entry.get("required", []) or not (gate or {}).get("tests"):
                    continue
                cell = (
                    counts.setdefault(original, {})
                    .setdefault(kind, {})
                    .setdefault(key, dict.fromkeys(OUTCOMES, 0))
                )
                cell[gate_result(gate)] += 1
    return {"runs": len(reports), "routes": counts}


def _order(key: str) -> tuple[int, float, str]:
    if key == "route":
        return 0, 0.0, key
    if key == COPY:
        return 1, 0.0, key
    number = key.rsplit("_", 1)[-1].removesuffix("pct").replace("p", ".")
    try:
        return 2, float(number), key
    except ValueError:
        return 3, 0.0, key


def render(section: Mapping[str, Any]) -> list[str]:
    """One row per route, gate and planted route: pass / inconclusive / fail counts of K."""
    header = f"{'route':<34} {'gate':<16} {'planted':<18} runs  pass  inconcl  fail  other"
    lines = [header, "-" * len(header)]
    for route, kinds in sorted(section["routes"].items()):
        for kind, keys in sorted(kinds.items()):
            for key in sorted(keys, key=_order):
                c = keys[key]
                other = c["error"] + c["pending"]
                lines.append(
                    f"{route:<34} {kind:<16} {key:<18} {sum(c.values()):>4}  {c['pass']:>4}  "
                    f"{c['inconclusive']:>7}  {c['fail']:>4}  {other:>5}"
                )
    return lines


def run(repeat: int, report: Path, pytest_args: Sequence[str]) -> dict[str, Any]:
    """Run the calibration self-test ``repeat`` times; tally, print and store the counts."""
    from pytest_dflash.evidence import report as reports

    if repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {repeat}")
    paths = [report.with_name(f"{report.stem}.run{i}{report.suffix}") for i in range(repeat)]
    done: list[Path] = []
    for i, path in enumerate(paths):
        argv = child.command(path, pytest_args, calibrate=True)
        print(f"[{i + 1}/{repeat}] " + " ".join(argv), flush=True)
        result = child.run(argv)
        code = result.code
        # interrupted from outside (Ctrl-C, timeout -s INT), or inside the child (pytest's exit
        # code 2): the runs that finished still count, and are said to
        if result.interrupted or (code == 2 and done):
            print(f"interrupted during run {i + 1} of {repeat}: counting the {len(done)} "
                  "finished runs", flush=True)
            break
        if code > 1 or not path.exists():
            why = _WHY.get(code, "pytest ended without writing its report")
            raise RepeatError(f"self-test run {i + 1} of {repeat} ended with pytest exit "
                              f"{code}: {why}; its report: {path}")
        done.append(path)
    if not done:
        raise RepeatError(f"no self-test run of {repeat} finished: nothing to count")
    loaded = [reports.load(path) for path in done]
    section = tally(loaded)
    section["reports"] = [str(p) for p in done]
    section["runs_asked"] = repeat
    last = dict(loaded[-1])
    last["selftest_repeat"] = section
    reports.write_atomic(last, done[-1])
    out = report.with_name(f"{report.stem}.repeat.json")
    out.write_text(json.dumps(section, indent=2) + "\n", encoding="utf-8")
    for line in render(section):
        print(line)
    print(f"counts: {out} (and the selftest_repeat section of {done[-1]})")
    return section
