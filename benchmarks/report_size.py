"""How big reports are, and what the compact form (``pytest_dflash.evidence.compact``) keeps.

For each report given, the file's size as written, and the same evidence in the form reports had
before compaction (indented, every round: only for a report written with
``--dflash-report-rounds all``, which keeps them) and compacted as a run writes it by default
(each timing process's summary and at most 32 rounds, compact JSON), plain and gzip-compressed;
with the rounds the report's timing processes timed and kept. Writes a
``pytest-dflash/benchmark/1`` file for ``benchmarks/render.py``:

    python benchmarks/report_size.py before.json after.json --label "main job, before" \\
        --label "main job, after" --out benchmarks/results/cpu-report-size.json \\
        --machine "..." --commit "..." --command "..." --about "..."
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import platform
import sys
from pathlib import Path
from typing import Any

from pytest_dflash.evidence import compact, timings


def rounds(report: dict[str, Any]) -> tuple[int, int, int]:
    """(timing processes, rounds they timed, rounds the report keeps)."""
    procs = timed = kept = 0
    for entry in report.get("routes", {}).values():
        for gate in entry.get("gates", {}).values():
            for test in gate.get("tests", []):
                for _, series in timings.comparisons(test.get("measurements", {})):
                    for proc in series.get("processes") or []:
                        procs += 1
                        timed += int(proc.get("rounds") or 0)
                        kept += len((proc.get("samples") or {}).get("candidate") or [])
    return procs, timed, kept


def forms(report: dict[str, Any]) -> dict[str, int | None]:
    """Bytes of ``report`` indented with every round (None when it holds a sample only), and
    compacted as compact JSON, plain and gzip-compressed."""
    _, timed, kept = rounds(report)
    whole = len(json.dumps(report, indent=2, default=str).encode()) if timed == kept else None
    routes = {name: {**entry, "gates": {kind: {**gate, "tests": [
        {**test, "measurements": compact.measurements(test.get("measurements", {}))}
        for test in gate.get("tests", [])]} for kind, gate in entry["gates"].items()}}
        for name, entry in report.get("routes", {}).items()}
    small = json.dumps({**report, "routes": routes}, separators=(",", ":"),
                       default=str).encode()
    return {"whole": whole, "compact": len(small),
            "gzip": len(gzip.compress(small, mtime=0))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--label", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    for name in ("machine", "commit", "command", "about"):
        parser.add_argument(f"--{name}", required=True)
    args = parser.parse_args(argv)
    if len(args.label) != len(args.reports):
        parser.error("give one --label per report")
    rows = []
    torch_version = cuda = python = None
    for label, path in zip(args.label, args.reports, strict=True):
        report = json.loads(path.read_text(encoding="utf-8"))
        torch_version = report["fingerprint"].get("torch")
        cuda = report["fingerprint"].get("cuda")
        python = report["fingerprint"].get("python") or platform.python_version()
        procs, timed, kept = rounds(report)
        size = forms(report)
        rows.append([label, report.get("profile"), report["device"].get("name"),
                     path.stat().st_size, "" if size["whole"] is None else size["whole"],
                     size["compact"], size["gzip"],
                     procs, timed, kept])
    result = {
        "schema": "pytest-dflash/benchmark/1", "kind": "measured", "topic": "reports",
        "title": "Report sizes: as written, and the same evidence in each form",
        "about": args.about, "machine": args.machine, "python": python,
        "torch": torch_version, "cuda": cuda, "commit": args.commit,
        "date": datetime.date.today().isoformat(), "command": args.command,
        "values": {"columns": ["report", "profile", "device", "bytes as written",
                               "indented, every round", "compacted", "compacted, gzip",
                               "timing processes", "rounds timed", "rounds kept"],
                   "rows": rows},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
