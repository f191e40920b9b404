"""``pytest-dflash``: read evidence reports outside pytest.

Exit status: 0 success (for ``verdict``: every candidate accepted), 1 a candidate is not
accepted, 2 a usage error, an unreadable, malformed or corrupt report, a report of other code
(``enable``), or a failed build. Every verdict printed here is recomputed from the report's
tests (``pytest_dflash.report.load``), never read from the stored field.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from pytest_dflash import report as reports
from pytest_dflash.table import render

#: fingerprint fields that say which code and kernels the evidence is about (checked by enable)
CODE_FIELDS = ("git_head", "git_dirty_sha256", "kernel_sources_sha256", "sidecar_sha256")


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
    changed = _foreign_fields(data["fingerprint"], Path(args.root))
    if changed and not args.any_fingerprint:
        raise reports.ReportError(
            f"{args.report}: enable refused: the report was measured on other code or kernels "
            f"than {Path(args.root).resolve()} ({'; '.join(changed)}); rerun the gates on this "
            "code, or pass --any-fingerprint to enable its routes anyway"
        )
    if changed:
        print(f"pytest-dflash: --any-fingerprint: enabling evidence of other code "
              f"({'; '.join(changed)})", file=sys.stderr)
    for entry in sorted(data["routes"].values(), key=lambda e: e["switch"]):
        if entry["verdict"] == "accept":
            print(f"{entry['switch']}=1")
    return 0


def _foreign_fields(recorded: dict, root: Path) -> list[str]:
    """``field: report -> here`` for every code/kernel fingerprint field that differs."""
    from pytest_dflash import fingerprint
    from pytest_dflash.loader import SIDECAR_ENV

    sidecar = os.environ.get(SIDECAR_ENV)
    here = fingerprint.collect(root, Path(sidecar) if sidecar else None)
    return [f"{name}: {recorded.get(name)} -> {here.get(name)}" for name in CODE_FIELDS
            if recorded.get(name) != here.get(name)]


def _build(args: argparse.Namespace) -> int:
    from pytest_dflash import build

    try:
        path = build.build_library(variant=args.variant, cache_dir=args.cache_dir)
    except build.BuildError as exc:
        log = _write_log(str(exc), args.cache_dir or build.default_cache_dir(), args.variant)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"pytest-dflash build: {first}\nfull command and compiler output: {log}",
              file=sys.stderr)
        return 2
    print(path)
    return 0


def _write_log(text: str, cache_dir: Path, variant: str) -> Path:
    """Keep a failed build's output in a file (the cache, else the temp dir) and return it."""
    name = f"build-{variant}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    try:
        folder = Path(cache_dir) / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_text(text + "\n", encoding="utf-8")
    except OSError:
        handle, tmp = tempfile.mkstemp(prefix="pytest-dflash-" + name)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text + "\n")
        path = Path(tmp)
    return path


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
    enable.add_argument("--root", default=".", help="checkout the switches are for; its code and "
                        "kernels must match the report's fingerprint (default: .)")
    enable.add_argument("--any-fingerprint", action="store_true",
                        help="enable even if the report was measured on other code or kernels")
    enable.set_defaults(run=_enable)
    build = sub.add_parser("build", help="build the bundled D256 op library ahead of time")
    build.add_argument("--variant", choices=("full", "dense_only"), default="full")
    build.add_argument("--cache-dir", type=Path, default=None,
                       help="cache directory (default: $DFLASH_CACHE_DIR or "
                       "~/.cache/pytest-dflash)")
    build.set_defaults(run=_build)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except reports.ReportError as exc:
        print(f"pytest-dflash: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
