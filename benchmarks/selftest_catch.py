"""The catch table of a real self-test run as a result file:
``benchmarks/results/cpu-selftest-catch.json`` (docs/selftest.md, "Reading the catch table").

    pytest -m sm70 --dflash-selftest --dflash-profile quick --dflash-report selftest.json
    python benchmarks/selftest_catch.py selftest.json [--out benchmarks/results/...json]
        [--machine "2-core CPU, ..."]

The table is recomputed from the report's recorded outcomes by the project's own reader
(``pytest_dflash.evidence.report.load``, which checks that the stored ``selftest`` section
equals what the tests say), never decided here: one row per original route and gate kind, as
``pytest-dflash selftest REPORT`` prints it, with every planted defect that was not caught named.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

from pytest_dflash.evidence.catch import CAUGHT, resolution_text
from pytest_dflash.evidence.report import ReportError, load

COLUMNS = ["route", "gate", "copy", "caught", "resolution", "not caught"]


def rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per original route and gate kind of the report's self-test section."""
    section = report.get("selftest") or {}
    out = []
    for route, kinds in sorted(section.get("routes", {}).items()):
        for kind, gate in kinds.items():
            if not gate["planted"]:
                continue  # a kind that was not selected: nothing planted ran
            copy = gate["copy"]["status"] if gate["copy"] else "-"
            missed = "; ".join(f"{d['key']} {d['status']}" for d in gate["defects"]
                               if d["status"] != CAUGHT)
            out.append([route, kind, copy, f"{gate['caught']}/{gate['planted']}",
                        resolution_text(kind, gate), missed or "-"])
    return out


def build(path: Path, machine: str) -> dict[str, Any]:
    """The result file's content (schema of benchmarks/render.py)."""
    try:
        report = load(path)
    except ReportError as exc:
        raise SystemExit(f"selftest_catch: {exc}") from None
    table = rows(report)
    if not table:
        raise SystemExit(f"selftest_catch: {path} holds no planted defect: run pytest with "
                         "--dflash-selftest and --dflash-report")
    fingerprint = report["fingerprint"]
    caught = sum(int(row[3].split("/")[0]) for row in table)
    planted = sum(int(row[3].split("/")[1]) for row in table)
    return {
        "schema": "pytest-dflash/benchmark/1",
        "kind": "measured",
        "topic": "gate self-test",
        "title": f"the catch table of the {report['profile']}-profile self-test",
        "about": (f"Every selected candidate with its planted defects and its unchanged copy "
                  f"({report['profile']} profile): {caught} of {planted} planted defects "
                  "caught. copy: the unchanged copy's gate status (it must be judged as the "
                  "route itself); resolution: the smallest planted slowdown a timing gate "
                  "resolved; not caught: each planted defect that was not rejected and why "
                  "(pending: inconclusive, never passed; missed: passed)."),
        "machine": machine,
        "python": fingerprint.get("python") or platform.python_version(),
        "torch": fingerprint.get("torch") or "unknown",
        "cuda": fingerprint.get("cuda"),
        "commit": (fingerprint.get("git_head") or "unknown")[:7],
        "date": report["created"][:10],
        "command": f"pytest -m sm70 --dflash-selftest --dflash-profile {report['profile']} "
                   "--dflash-report selftest.json; python benchmarks/selftest_catch.py "
                   "selftest.json",
        "values": {"columns": COLUMNS, "rows": table},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results"
                        / "cpu-selftest-catch.json")
    parser.add_argument("--machine", default=f"{platform.machine()} CPU",
                        help="the machine, as the result file names it")
    args = parser.parse_args(argv)
    result = build(args.report, args.machine)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(result['values']['rows'])} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
