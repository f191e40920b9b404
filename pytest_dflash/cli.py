"""``pytest-dflash``: read evidence reports outside pytest.

Exit status: 0 success (for ``verdict``: every candidate accepted), 1 a candidate is not
accepted, 2 a usage error or an unreadable report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pytest_dflash import report as reports
from pytest_dflash.table import render


def _verdict(args: argparse.Namespace) -> int:
    data = reports.load(Path(args.report))
    print(f"profile {data['profile']}, device {data['device'].get('name')}, "
          f"created {data['created']}")
    for line in render(data):
        print(line)
    verdicts = [entry["verdict"] for entry in data["routes"].values()]
    return 0 if verdicts and all(v == "accept" for v in verdicts) else 1


def _diff(args: argparse.Namespace) -> int:
    old, new = reports.load(Path(args.old)), reports.load(Path(args.new))
    lines: list[str] = []
    for name in sorted(set(old["routes"]) | set(new["routes"])):
        before, after = old["routes"].get(name), new["routes"].get(name)
        if before is None or after is None:
            lines.append(f"{name}: {'added' if before is None else 'removed'}")
            continue
        if before["verdict"] != after["verdict"]:
            lines.append(f"{name}: verdict {before['verdict']} -> {after['verdict']}")
        for kind in sorted(set(before["gates"]) | set(after["gates"])):
            gate_a = before["gates"].get(kind, {"status": "absent", "figure": ""})
            gate_b = after["gates"].get(kind, {"status": "absent", "figure": ""})
            if gate_a["status"] != gate_b["status"] or gate_a["figure"] != gate_b["figure"]:
                lines.append(f"{name} {kind}: {gate_a['status']} ({gate_a['figure'] or '-'})"
                             f" -> {gate_b['status']} ({gate_b['figure'] or '-'})")
    if old["fingerprint"] != new["fingerprint"]:
        changed = sorted(k for k in set(old["fingerprint"]) | set(new["fingerprint"])
                         if old["fingerprint"].get(k) != new["fingerprint"].get(k))
        lines.append(f"fingerprint changed: {', '.join(changed)}")
    print("\n".join(lines) if lines else "no differences")
    return 0


def _enable(args: argparse.Namespace) -> int:
    data = reports.load(Path(args.report))
    for entry in sorted(data["routes"].values(), key=lambda e: e["switch"]):
        if entry["verdict"] == "accept":
            print(f"{entry['switch']}=1")
    return 0


def _build(args: argparse.Namespace) -> int:
    from pytest_dflash import build

    path = build.build_library(variant=args.variant)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pytest-dflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    verdict = sub.add_parser("verdict", help="print the verdict table of a report")
    verdict.add_argument("report")
    verdict.set_defaults(run=_verdict)
    diff = sub.add_parser("diff", help="what changed between two reports, per route and gate")
    diff.add_argument("old")
    diff.add_argument("new")
    diff.set_defaults(run=_diff)
    enable = sub.add_parser("enable", help="print NAME=1 for every accepted route")
    enable.add_argument("report")
    enable.set_defaults(run=_enable)
    build = sub.add_parser("build", help="build the bundled D256 op library ahead of time")
    build.add_argument("--variant", choices=("full", "dense_only"), default="full")
    build.set_defaults(run=_build)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except reports.ReportError as exc:
        print(f"pytest-dflash: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
