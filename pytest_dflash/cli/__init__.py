"""``pytest-dflash``: read, join and render evidence reports outside pytest.

Exit status: 0 success (for ``verdict``: every candidate accepted), 1 a candidate is not
accepted, 2 a usage error, an unreadable, malformed or corrupt report, a report of other code
(``enable``), or a failed build. Every verdict printed here is recomputed from the report's
tests (``pytest_dflash.evidence.report.load``), never read from the stored field.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from pytest_dflash.evidence import report as reports

#: fingerprint fields that say which code and kernels the evidence is about (checked by enable)
CODE_FIELDS = ("git_head", "git_dirty_sha256", "kernel_sources_sha256", "sidecar_sha256")


def _verdict(args: argparse.Namespace) -> int:
    from pytest_dflash.evidence.summary import all_accepted, render_summary

    data = reports.load(Path(args.report))
    sys.stdout.write(render_summary(data, args.format))
    return 0 if all_accepted(data) else 1


def _diff(args: argparse.Namespace) -> int:
    from pytest_dflash.evidence import history
    old, new = reports.load(Path(args.old)), reports.load(Path(args.new))
    result = history.compare(old, new)
    print("\n".join(result.lines()))
    return 1 if result.worse else 0


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
    for entry in sorted(data["routes"].values(), key=lambda entry: entry["switch"]):
        if entry["verdict"] == "accept" and "planted" not in entry:
            print(f"{entry['switch']}=1")
    return 0


def _foreign_fields(recorded: dict, root: Path) -> list[str]:
    """``field: report -> here`` for every code/kernel fingerprint field that differs."""
    from pytest_dflash.evidence import fingerprint
    from pytest_dflash.native.loader import SIDECAR_ENV

    sidecar = os.environ.get(SIDECAR_ENV)
    here = fingerprint.collect(root, Path(sidecar) if sidecar else None)
    return [f"{name}: {recorded.get(name)} -> {here.get(name)}" for name in CODE_FIELDS
            if recorded.get(name) != here.get(name)]


def _plot(args: argparse.Namespace) -> int:
    from pytest_dflash.evidence.plot import PlotError, plot_report

    data = reports.load(Path(args.report))
    try:
        written = plot_report(data, Path(args.output))
    except PlotError as exc:
        print(f"pytest-dflash: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    if not written:
        print("no gate in this report recorded samples, cases or per-task outcomes to plot",
              file=sys.stderr)
    return 0


def _merge(args: argparse.Namespace) -> int:
    """Join shard reports into OUT (refusals and bad inputs: ReportError, exit 2)."""
    from pytest_dflash.evidence.merge import merge_files
    from pytest_dflash.evidence.summary import counts

    merged = merge_files(Path(args.out), [Path(p) for p in args.reports])
    tally = counts(merged)
    missing = merged["shards"]["missing"]
    count = merged["shards"]["count"]
    print(f"{args.out}: {len(args.reports)} reports merged; accept {tally['accept']}, reject "
          f"{tally['reject']}, pending {tally['pending']}"
          + (f"; missing shards: {', '.join(f'{k}/{count}' for k in missing)}" if missing
             else ""))
    return 0


def _history(args: argparse.Namespace) -> int:
    from pytest_dflash.evidence import history
    listed = history.entries(Path(args.root))
    if not listed:
        print(f"no runs stored under {Path(args.root) / history.HISTORY_DIR}; "
              "save one with pytest --dflash-save")
    for e in listed:
        v = e["verdicts"]
        print(f"{e['seq']:>4}  {e['created']}  {e['name'] or '-':<16} {e['profile']:<5} "
              f"{e['device']}  {e['fingerprint']}  accept {v.get('accept', 0)} reject "
              f"{v.get('reject', 0)} pending {v.get('pending', 0)}  {e['file']}")
    return 0


def _selftest(args: argparse.Namespace) -> int:
    """The catch table of a report (``--run``: run the self-test first, through pytest)."""
    from pytest_dflash.evidence import catch

    if args.repeat is not None:
        from pytest_dflash.selftest import repeat

        try:
            section = repeat.run(args.repeat, Path(args.report), args.pytest_args or [])
        except repeat.RepeatError as exc:
            print(f"pytest-dflash selftest: {exc}", file=sys.stderr)
            return 2
        bad = [(route, kind) for route, kinds in section["routes"].items()
               for kind, keys in kinds.items() if keys.get("copy", {}).get("fail")]
        return 1 if bad else 0
    if args.pytest_args is not None:
        from pytest_dflash.selftest import child

        argv = child.command(args.report, args.pytest_args)
        print(" ".join(argv), flush=True)
        result = child.run(argv)
        if result.interrupted:  # the child printed its tables; its report keeps what finished
            print(f"pytest-dflash selftest: interrupted; {args.report} holds the tests that "
                  "finished", file=sys.stderr)
            return 2
        return result.code
    section = catch.summarize(reports.load(Path(args.report)))
    for line in catch.render(section):
        print(line)
    return 1 if catch.marks(section) else 0


def _build(args: argparse.Namespace) -> int:
    from pytest_dflash.native import build
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


def _serve(args: argparse.Namespace) -> int:
    try:
        from pytest_dflash.engines import serve
    except ImportError as exc:
        print(f"pytest-dflash serve needs the serve extra ({exc}): pip install "
              "'pytest-dflash[serve]'", file=sys.stderr)
        return 2
    try:
        serve.serve(args.host, args.port, args.profile, args.device, args.plugin,
                    model_name=args.served_model_name, log_level=args.log_level)
    except ImportError as exc:
        print(f"pytest-dflash serve needs the serve extra ({exc}): pip install "
              "'pytest-dflash[serve]'", file=sys.stderr)
        return 2
    except ValueError as exc:  # ServeError, unknown routes, bad selections
        print(f"pytest-dflash serve: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pytest-dflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    verdict = sub.add_parser("verdict", help="print the verdict table of a report")
    verdict.add_argument("report")
    verdict.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                         help="text (terminal), markdown (PR comment, $GITHUB_STEP_SUMMARY), json")
    verdict.set_defaults(run=_verdict)
    diff = sub.add_parser("diff", help="what changed between two reports, per route and gate; "
                                       "exit 1 if a verdict or gate got worse")
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
    plot = sub.add_parser("plot", help="PNG and SVG pictures of a report's samples and cases")
    plot.add_argument("report")
    plot.add_argument("-o", "--output", default="dflash-plots", help="output folder")
    plot.set_defaults(run=_plot)
    merge = sub.add_parser("merge", help="join the reports of a job's shards (run with "
                           "--dflash-shard K/N, e.g. on several hosts) into one report OUT; "
                           "refused (exit 2) for other code, mixed card models in one gate, or "
                           "a test with two outcomes")
    merge.add_argument("out", help="the merged report to write")
    merge.add_argument("reports", nargs="+", metavar="REPORT", help="shard reports")
    merge.set_defaults(run=_merge)
    hist = sub.add_parser("history", help="list the runs kept by pytest --dflash-save")
    hist.add_argument("--root", default=".", help="folder holding .dflash/ (default: here)")
    hist.set_defaults(run=_history)
    selftest = sub.add_parser(
        "selftest", help="the self-test's catch table of a report (exit 1 if a gate missed a "
        "planted defect); with --run, run `pytest -m sm70 --dflash-selftest` first")
    selftest.add_argument("report", nargs="?", default="dflash-report.json")
    selftest.add_argument("--repeat", type=int, default=None, metavar="K",
                          help="run the timing calibration self-test K times (each timing "
                               "gate's unchanged copy and 1/2/5/10%% slowdowns) and print, per "
                               "gate, how many runs passed, were inconclusive or failed; exit 1 "
                               "if an unchanged copy ever failed (pytest arguments after --run)")
    selftest.add_argument("--run", nargs=argparse.REMAINDER, default=None, dest="pytest_args",
                          metavar="PYTEST_ARGS",
                          help="run the self-test (remaining arguments go to pytest, e.g. "
                               "--dflash-profile quick --dflash-route NAME)")
    selftest.set_defaults(run=_selftest)
    build = sub.add_parser("build", help="build the bundled native op library ahead of time "
                           "(every variant; prints the path of --variant's)")
    build.add_argument("--variant", choices=("full", "dense_only"), default="full")
    build.add_argument("--cache-dir", type=Path, default=None,
                       help="cache directory (default: $DFLASH_CACHE_DIR or "
                       "~/.cache/pytest-dflash)")
    build.set_defaults(run=_build)
    serve = sub.add_parser(
        "serve", help="serve the reference engine over an OpenAI-compatible HTTP API; routes "
                      "from the NAME=1 enable switches in the environment")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--profile", choices=("quick", "ci", "full"), default=None,
                       help="engine sizes (default: $DFLASH_PROFILE, else ci)")
    serve.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                       help="(default: $DFLASH_DEVICE, else cpu)")
    serve.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                       help="module whose pytest_dflash_routes(registry) registers more routes "
                            "(repeatable)")
    serve.add_argument("--served-model-name", default="dflash-reference")
    serve.add_argument("--log-level", default="warning",
                       choices=("critical", "error", "warning", "info", "debug"))
    serve.set_defaults(run=_serve)
    args = parser.parse_args(argv)
    try:
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except reports.ReportError as exc:
        print(f"pytest-dflash: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader stopped reading (``pytest-dflash diff A B | head``): not an error of ours;
        # stdout goes to devnull so the interpreter's own flush at exit cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1

