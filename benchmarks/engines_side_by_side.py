"""The six shipped candidates judged by both engines, and what the transformers job costs:
``benchmarks/results/engines-side-by-side.json`` (docs/engines.md, "Both engines side by side").

    python benchmarks/engines_side_by_side.py --reference REF.json --transformers HF.json \
        --times TIMES.json [--out benchmarks/results/engines-side-by-side.json]
        [--quick-report HF_QUICK.json] [--profile ci] [--route NAME ...]

``REF.json`` is the report of the reference engine's main job (``pytest -m sm70``, ci
profile), ``HF.json`` the report of the same suites on the transformers engine
(``pytest --pyargs dflash_suites -m sm70 --dflash-engine hf --dflash-profile ci``), both from
one machine. Verdicts, gate outcomes and deciding figures are read through the project's own
report reader (``pytest_dflash.evidence``: validated, verdicts recomputed from the recorded
tests), never decided here. ``TIMES.json`` is a list of ``{"name", "wall_s", "summary", ...}``
rows, one per job, with the job names below; it gives the cost of the ci transformers job
against the main job (limit: 1.5 times) and of the quick-profile transformers job of the six
candidates (limit for ``.ci/run``'s job: 120 s of tests, pytest's own session time); that job's
report, where given, says which of its tests took longest.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

from pytest_dflash.evidence.report import ReportError, judged, load
from pytest_dflash.evidence.verdict import gate_outcome
from pytest_dflash.routes.vocabulary import GATE_KINDS

CANDIDATES = (
    "attn.d256.fa2",
    "gemm.nvfp4.qpn2",
    "gemm.nvfp4.qpn4_bounded",
    "gemm.nvfp4.qpn2_packed",
    "prefill.geometry.fp32_q6592",
    "prefill.geometry.fp16_q7920",
)
# the model-level gates: the only ones whose engine differs between the two jobs
MODEL_LEVEL = ("prefill", "validation_cost", "ppl", "quality")
ENGINE_CLASS = {"reference": "ReferenceEngine", "transformers": "TransformersEngine"}
# job names of TIMES.json (the main job may have run more than once, around the others)
MAIN_JOBS = ("ref-ci", "ref-ci-2")
HF_CI_JOB, HF_QUICK_JOB = "hf-ci", "hf-quick"
# .ci/run's transformers job: the quick profile, every shipped candidate but fa2 (its one
# model-level gate cannot show a gain at the quick profile's 256 and 512 tokens)
QUICK_JOB = "quick transformers job as .ci/run runs it (fa2 left out)"
CI_RATIO_LIMIT = 1.5  # the ci transformers job against the main job, same machine
QUICK_TEST_LIMIT_S = 120.0  # .ci/run's transformers job, seconds of tests
COMMANDS = {  # the jobs as run for the committed file (--durations: where the time went)
    "reference": "pytest -m sm70 -p no:cacheprovider --durations=40 --dflash-report ref-ci.json",
    "transformers": "pytest --pyargs dflash_suites -m sm70 --dflash-engine hf --dflash-profile ci "
    "-p no:cacheprovider --durations=40 --dflash-report hf-ci.json",
    "quick": "pytest --pyargs dflash_suites.test_ppl dflash_suites.test_quality "
    "dflash_suites.test_speed_prefill dflash_suites.test_validation_cost_engine -m sm70 "
    "--dflash-engine hf --dflash-profile quick (the --dflash-route of every candidate but fa2, "
    "as .ci/run runs it) --durations=40 --dflash-report hf-quick.json",
}


# the loader gate names the native library's build id ("bundled <12 hex digits> on cpu")
BUILD_HASH = re.compile(r"(?<=bundled )[0-9a-f]{12,} ")


class SideBySideError(ValueError):
    """An input that cannot give the table; the message names the file and the fix."""


def read_report(path: Path, engine: str, profile: str = "ci",
                candidates: tuple[str, ...] = CANDIDATES) -> dict[str, Any]:
    """The report at ``path``, read by the project's reader, checked to be a ``profile`` run of
    ``engine`` that judged every one of ``candidates``."""
    try:
        report = load(path)
    except ReportError as exc:
        raise SideBySideError(str(exc)) from None
    if report["profile"] != profile:
        raise SideBySideError(f"{path}: profile {report['profile']!r}; the comparison is of "
                              f"{profile}-profile runs: rerun with --dflash-profile {profile}")
    routes = judged(report["routes"])
    missing = [name for name in candidates if name not in routes]
    if missing:
        raise SideBySideError(f"{path}: no route {', '.join(missing)}: run the job on every "
                              "shipped candidate (no --dflash-route)")
    ran = engines_of(routes)
    if ran and ran != {ENGINE_CLASS[engine]}:
        raise SideBySideError(f"{path}: its model-level gates ran {', '.join(sorted(ran))}, not "
                              f"the {engine} engine ({ENGINE_CLASS[engine]}): pass the "
                              f"{engine} job's report")
    return report


def engines_of(routes: dict[str, Any]) -> set[str]:
    """The engine classes the model-level gates recorded (``dflash_gate.record_engines``)."""
    return {engine["engine"] for entry in routes.values()
            for kind in MODEL_LEVEL for test in entry["gates"].get(kind, {}).get("tests", [])
            for engine in test.get("measurements", {}).get("engines", [])}


def gate_cell(entry: dict[str, Any], kind: str) -> str:
    """A gate's outcome as the report states it, and its deciding figure."""
    if kind not in entry["required"]:
        return "not required"
    gate = entry["gates"][kind]
    figure = gate.get("figure") or ""
    outcome = gate_outcome(gate)
    if outcome == "pending" and not gate["tests"]:
        return "pending: did not run"
    if not figure:
        reasons = [r for r in entry["reasons"] if r.startswith(f"{kind} ")]
        figure = reasons[0].split(": ", 1)[-1] if reasons else ""
    figure = BUILD_HASH.sub("", figure)  # the op library's build id: the same in both jobs
    return f"{outcome}: {figure}" if figure else outcome


def verdict_cell(entry: dict[str, Any]) -> str:
    """The route's verdict and the gates that are not passed, as the report gives them."""
    open_gates = [f"{kind} {gate_outcome(entry['gates'][kind])}" for kind in entry["required"]
                  if entry["gates"][kind]["status"] != "passed"]
    return entry["verdict"] + (f" ({', '.join(open_gates)})" if open_gates else "")


def verdict_rows(reference: dict[str, Any], transformers: dict[str, Any],
                 candidates: tuple[str, ...] = CANDIDATES) -> list[list[str]]:
    """Per candidate: the verdict row, then one row per gate either engine requires."""
    ref, hf = judged(reference["routes"]), judged(transformers["routes"])
    rows = []
    for name in candidates:
        rows.append([name, "verdict", verdict_cell(ref[name]), verdict_cell(hf[name])])
        kinds = set(ref[name]["required"]) | set(hf[name]["required"])
        for kind in (k for k in GATE_KINDS if k in kinds):
            rows.append([name, kind, gate_cell(ref[name], kind), gate_cell(hf[name], kind)])
    return rows


def session_seconds(summary: str) -> float | None:
    """pytest's own session time from its last line (``... in 93.41s (0:01:33)``)."""
    found = re.search(r" in ([0-9.]+)s\b", summary)
    return float(found.group(1)) if found else None


def read_times(path: Path) -> dict[str, dict[str, Any]]:
    """TIMES.json's rows by job name; each named job must be there."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SideBySideError(f"{path}: cannot read the job times ({exc})") from None
    jobs = {row["name"]: row for row in rows if isinstance(row, dict) and "name" in row}
    needed = [n for n in (MAIN_JOBS[0], HF_CI_JOB, HF_QUICK_JOB) if n not in jobs]
    if needed:
        raise SideBySideError(f"{path}: no job {', '.join(needed)}; it lists "
                              f"{', '.join(jobs) or 'none'}")
    return jobs


def test_seconds(report: dict[str, Any], names: list[str]) -> float:
    """Seconds the report's tests of routes ``names`` took (``duration_s`` of each test)."""
    routes = report["routes"]
    return sum(test.get("duration_s") or 0.0 for name in names
               for gate in routes[name]["gates"].values() for test in gate["tests"])


def cost_rows(jobs: dict[str, dict[str, Any]], reference: dict[str, Any],
              transformers: dict[str, Any],
              candidates: tuple[str, ...]) -> tuple[list[list[Any]], dict[str, Any]]:
    """Rows of the cost figures, and the figures themselves: the jobs' wall times, and where
    the seconds of their tests went (the candidates compared; the routes only one engine has,
    such as the transformers engine's own ``prefill.geometry.hf_*``)."""
    mains = [jobs[n] for n in MAIN_JOBS if n in jobs]
    shared = list(candidates)
    only_hf = sorted(set(judged(transformers["routes"])) - set(judged(reference["routes"])))
    seconds = {"reference": test_seconds(reference, shared),
               "transformers": test_seconds(transformers, shared),
               "transformers_only": test_seconds(transformers, only_hf)}
    hf, quick = jobs[HF_CI_JOB], jobs[HF_QUICK_JOB]
    ratios = [hf["wall_s"] / m["wall_s"] for m in mains]
    quick_tests = session_seconds(quick.get("summary", ""))
    figures = {
        "main_job_wall_s": [m["wall_s"] for m in mains],
        "hf_ci_job_wall_s": hf["wall_s"],
        "hf_ci_over_main": [round(r, 3) for r in ratios],
        "hf_ci_over_main_limit": CI_RATIO_LIMIT,
        "hf_quick_job_wall_s": quick["wall_s"],
        "hf_quick_job_test_s": quick_tests,
        "hf_quick_job_test_limit_s": QUICK_TEST_LIMIT_S,
        "candidates_test_s": {"reference": round(seconds["reference"], 1),
                              "transformers": round(seconds["transformers"], 1)},
        "transformers_only_routes": only_hf,
        "transformers_only_routes_test_s": round(seconds["transformers_only"], 1),
    }
    main_cell = " and ".join(f"{m['wall_s']:.0f} s" for m in mains)
    ratio_cell = " and ".join(f"{r:.2f}x" for r in ratios)
    rows: list[list[Any]] = [
        ["ci job (-m sm70, ci profile)", "wall time", main_cell,
         f"{hf['wall_s']:.0f} s: {ratio_cell} the main job (limit {CI_RATIO_LIMIT}x)"],
        ["ci job (-m sm70, ci profile)", "pytest summary",
         " / ".join(m["summary"].strip() for m in mains), hf["summary"].strip()],
        ["ci job (-m sm70, ci profile)", "tests of the compared candidates",
         f"{seconds['reference']:.0f} s", f"{seconds['transformers']:.0f} s"],
        ["ci job (-m sm70, ci profile)", "tests of routes only this engine has", "-",
         f"{seconds['transformers_only']:.0f} s ({', '.join(only_hf) or 'none'})"],
        [QUICK_JOB, "wall time", "-",
         f"{quick['wall_s']:.0f} s; tests {quick_tests:.0f} s (limit {QUICK_TEST_LIMIT_S:.0f} s)"
         if quick_tests is not None else f"{quick['wall_s']:.0f} s"],
    ]
    return rows, figures


def slowest(report: dict[str, Any], count: int = 3) -> str:
    """The ``count`` longest tests of a report, with their seconds (``duration_s``)."""
    tests = [(test.get("duration_s") or 0.0, test["nodeid"].rsplit("::", 1)[-1])
             for entry in report["routes"].values() for gate in entry["gates"].values()
             for test in gate["tests"]]
    return ", ".join(f"{name} {seconds:.0f} s" for seconds, name in sorted(tests)[::-1][:count])


def machine(report: dict[str, Any], jobs: dict[str, dict[str, Any]]) -> str:
    """The device the reports name, and the load average before each job (TIMES.json)."""
    loads = [f"{name} {jobs[name]['load_before']}" for name in (*MAIN_JOBS, HF_CI_JOB,
                                                                HF_QUICK_JOB)
             if jobs.get(name, {}).get("load_before")]
    device = report.get("device", {}).get("name") or "unknown device"
    line = f"{platform.machine()} {device}, the jobs one after another"
    return line + (f" (1-minute load average before each: {'; '.join(loads)})" if loads else "")


def build(reference_path: Path, transformers_path: Path, times_path: Path, profile: str = "ci",
          candidates: tuple[str, ...] = CANDIDATES,
          quick_path: Path | None = None) -> dict[str, Any]:
    """The result file's content (schema of benchmarks/render.py)."""
    reference = read_report(reference_path, "reference", profile, candidates)
    transformers = read_report(transformers_path, "transformers", profile, candidates)
    jobs = read_times(times_path)
    heads = {r["fingerprint"].get("git_head") for r in (reference, transformers)}
    costs, cost_figures = cost_rows(jobs, reference, transformers, candidates)
    if quick_path is not None:
        try:
            quick = load(quick_path)
        except ReportError as exc:
            raise SideBySideError(str(exc)) from None
        cost_figures["hf_quick_job_slowest_tests"] = slowest(quick)
        costs.append([QUICK_JOB, "longest tests", "-",
                      cost_figures["hf_quick_job_slowest_tests"]])
    fingerprint = transformers["fingerprint"]
    return {
        "schema": "pytest-dflash/benchmark/1",
        "kind": "measured",
        "topic": "transformers engine",
        "title": "the six shipped candidates on both engines, and what the transformers job costs",
        "about": "Verdict and each gate's outcome and deciding figure of the six shipped "
                 "candidates, from the main job's report on the reference engine and the same "
                 "suites' report on the transformers engine (the tiny Qwen3.5 hybrid), ci "
                 "profile, one run each on one machine; op-level gates run the same code in "
                 "both jobs. Then the wall time of the ci transformers job against the main "
                 "job, and of .ci/run's quick transformers job.",
        "machine": machine(transformers, jobs),
        "python": fingerprint.get("python") or platform.python_version(),
        "torch": fingerprint.get("torch") or "unknown",
        "cuda": fingerprint.get("cuda"),
        "commit": sorted(h[:7] for h in heads if h) or ["unknown"],
        "date": transformers["created"][:10],
        "command": f"{COMMANDS['reference']}; {COMMANDS['transformers']}; "
                   f"{COMMANDS['quick']}; each timed (wall seconds, times.json); then python "
                   "benchmarks/engines_side_by_side.py --reference ref-ci.json --transformers "
                   "hf-ci.json --times times.json --quick-report hf-quick.json",
        "values": {
            "columns": ["candidate or job", "gate or figure", "reference engine",
                        "transformers engine"],
            "rows": verdict_rows(reference, transformers, candidates) + costs,
        },
        "cost": cost_figures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--transformers", type=Path, required=True)
    parser.add_argument("--times", type=Path, required=True)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "engines-side-by-side.json")
    parser.add_argument("--quick-report", type=Path, default=None,
                        help="the quick transformers job's report (its longest tests)")
    parser.add_argument("--profile", default="ci", help="the profile both reports ran")
    parser.add_argument("--route", action="append", default=[], metavar="NAME",
                        help="compare only this candidate (repeatable; default: the six "
                             "shipped candidates)")
    args = parser.parse_args(argv)
    try:
        result = build(args.reference, args.transformers, args.times, args.profile,
                       tuple(args.route) or CANDIDATES, args.quick_report)
    except SideBySideError as exc:
        print(f"engines_side_by_side: {exc}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({time.strftime('%H:%M:%S')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
