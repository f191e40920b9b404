"""The rounding spread of the ppl gate's figures: how far perplexity moves when nothing but
floating-point rounding changes, which sets the default ppl tolerances (docs/gates.md, "ppl").

    python benchmarks/ppl_spread.py [--profile ci] [--hf-model fixtures/hf_model] \
        [--runs 2] [--out benchmarks/results/ppl-rounding-spread.json]

Runs the shipped ppl gate (held-out segments and long contexts) ``--runs`` times on the
reference engine and on the transformers engine's tiny model, each time in a fresh pytest
process (all of them at once), and reads the per-segment and per-band perplexities back from
the reports. Two spreads, both as the relative change of perplexity |PPL_b / PPL_a - 1| (per
token, per byte, per band):

- identical code: the same route's figures between two runs;
- rounding-equivalent routes: a candidate that computes the same function as its baseline and
  differs only in rounding (fp32 in another order: a chunk size, eager attention, a static
  cache; or the fp16 state the SM70 deployment stores) against that baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# engine -> (extra pytest arguments, rounding-equivalent candidates: what differs)
ENGINES = {
    "reference": ([], {
        "prefill.geometry.fp32_q6592": "fp32, chunk 6592 instead of 3296 (summation order)",
        "prefill.geometry.fp16_q7920": "SSM state stored in fp16 between chunks, chunk 7920",
    }),
    "transformers": (["--dflash-engine", "hf"], {
        "prefill.geometry.hf_eager": "eager attention instead of sdpa (fp32)",
        "prefill.geometry.hf_q824": "prefill chunk 824 over the cache (fp32)",
        "prefill.geometry.hf_static_cache": "static cache instead of dynamic (fp32)",
    }),
}


def rel(a: float, b: float) -> float:
    """|b / a - 1|: the relative change of a perplexity from ``a`` to ``b``."""
    return abs(b / a - 1.0)


def figures(report: dict, route: str) -> dict[str, list[tuple[float, float]]]:
    """(baseline, candidate) perplexity pairs of one route's ppl tests, by kind of figure."""
    out: dict[str, list[tuple[float, float]]] = {"token": [], "byte": [], "band": []}
    for test in report["routes"][route]["gates"]["ppl"]["tests"]:
        m = test.get("measurements", {})
        if "per_segment_baseline" in m:
            out["token"] += list(zip(m["per_segment_baseline"], m["per_segment_candidate"],
                                     strict=True))
            out["byte"] += list(zip(m["per_segment_bytes_baseline"],
                                    m["per_segment_bytes_candidate"], strict=True))
        for rows in m.get("bands", {}).values():
            out["band"] += [(r["ppl_baseline"], r["ppl_candidate"]) for r in rows]
    return out


def run(engine: str, profile: str, hf_model: str | None, tmp: Path, index: int) -> dict:
    extra, routes = ENGINES[engine]
    if engine == "transformers" and hf_model:
        extra = ["--dflash-engine", f"hf:{hf_model}"]
    path = tmp / f"{engine}-{index}.json"
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "dflash_suites", "-m", "ppl",
           "--dflash-profile", profile, "-p", "no:cacheprovider", "-q", *extra,
           "--dflash-every-test",  # every segment's figures, also after a gate has failed
           f"--dflash-report={path}"]
    for route in routes:
        cmd += ["--dflash-route", route]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if not path.exists():
        raise SystemExit(f"{engine} run {index} wrote no report (exit {done.returncode}):\n"
                         f"{done.stdout[-3000:]}{done.stderr[-2000:]}")
    report = json.loads(path.read_text())
    report["_seconds"] = round(time.perf_counter() - start, 1)
    path.with_suffix(".seconds").write_text(str(report["_seconds"]))
    return report


def spread(reports: list[dict], routes: dict[str, str]) -> dict:
    """Both spreads of one engine's runs, per kind of figure (max over segments / bands)."""
    out: dict = {"identical_code": {}, "rounding_equivalent": {}}
    for route, what in routes.items():
        per_run = [figures(r, route) for r in reports]
        first = per_run[0]
        out["rounding_equivalent"][route] = {
            "what": what,
            **{kind: max((rel(b, c) for b, c in pairs), default=None)
               for kind, pairs in first.items()},
            "verdict": reports[0]["routes"][route]["gates"]["ppl"]["status"],
        }
        for other in per_run[1:]:
            for side, pick in (("baseline", 0), ("candidate", 1)):
                key = f"{route} ({side})" if side == "candidate" else "baseline"
                entry = out["identical_code"].setdefault(key, {})
                for kind in first:
                    values = [rel(a[pick], b[pick])
                              for a, b in zip(first[kind], other[kind], strict=True)]
                    entry[kind] = max(entry.get(kind) or 0.0, max(values, default=0.0))
    return out


def quoted_rows() -> list[list]:
    """Rounding-equivalent spreads already in committed result files (the seam figures of the
    CPU, the H200's full-profile main job): the relative change recomputed from them."""
    import re

    results = ROOT / "benchmarks" / "results"
    rows: list[list] = []
    seam = json.loads((results / "cpu-seam-figures.json").read_text())["values"]
    for route in ("fp32_q6592", "fp16_q7920"):
        bands = seam["routes"][route]["long_context_bands"]
        worst = max(rel(b["ppl_baseline"], b["ppl_candidate"])
                    for rows_ in bands.values() for b in rows_)
        rows.append(["reference (cpu-seam-figures.json)", "rounding-equivalent route",
                     f"prefill.geometry.{route}", "ci long context, bands after every seam",
                     "-", "-", _pct(worst), "-"])
    lowest = min(b["ppl_baseline"] for route in seam["routes"].values()
                 for rows_ in route["long_context_bands"].values() for b in rows_)
    full = json.loads((results / "h200-main-job-full.json").read_text())["values"]["rows"]
    for row in full:
        if row[1] != "ppl":
            continue
        band = re.search(r"max band PPL delta ([0-9.]+)", row[4])
        seg = re.search(r"per-segment PPL delta ([0-9.]+) .*?PPL ([0-9.]+) ->", row[4])
        # figures rounded to 4 places: the largest value they stand for, over the lowest band
        # perplexity of the reference model's held-out long context on the CPU
        rows.append(["reference, one H200, full (h200-main-job-full.json)",
                     "rounding-equivalent route", row[0],
                     "figures rounded to 4 places: upper bound",
                     _pct((float(seg.group(1)) + 5e-5) / float(seg.group(2))) if seg else "-",
                     "-", _pct((float(band.group(1)) + 5e-5) / lowest) if band else "-",
                     row[2]])
    return rows


def engine_of(report: dict) -> str:
    """The engine a report's ppl tests ran on, from their recorded engines."""
    for entry in report["routes"].values():
        for test in entry["gates"].get("ppl", {}).get("tests", []):
            for engine in test.get("measurements", {}).get("engines", []):
                name = str(engine.get("engine", "engine"))
                return {"TransformersEngine": "transformers",
                        "ReferenceEngine": "reference"}.get(name, name)
    return "engine"


def _kept(folder: Path, engine: str, index: int) -> dict:
    report = json.loads((folder / f"{engine}-{index}.json").read_text())
    seconds = folder / f"{engine}-{index}.seconds"
    report["_seconds"] = float(seconds.read_text()) if seconds.exists() else None
    return report


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--hf-model", default=None)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the runs' reports in this folder")
    parser.add_argument("--contrast", type=Path, nargs="*", default=[],
                        help="reports of routes that change precision, shown for contrast")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="read the reports kept by an earlier --keep instead of running")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks/results/ppl-rounding-spread.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    rows: list[list] = []
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        jobs = [(engine, i) for engine in args.engines for i in range(args.runs)]
        if args.reuse:  # the reports of an earlier run of this script (--keep), not rerun
            done = {(e, i): _kept(args.reuse, e, i) for e, i in jobs}
        else:
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:  # each run a process
                done = dict(zip(jobs, pool.map(
                    lambda job: run(job[0], args.profile, args.hf_model, tmp, job[1]), jobs),
                    strict=True))
        for engine in args.engines:
            reports = [done[(engine, i)] for i in range(args.runs)]
            seconds[engine] = [r.get("_seconds") for r in reports]
            found = spread(reports, ENGINES[engine][1])
            for key, figs in found["identical_code"].items():
                rows.append([engine, "identical code, two runs", key, "the same route",
                             *(_pct(figs.get(k)) for k in ("token", "byte", "band")), "-"])
            for route, figs in found["rounding_equivalent"].items():
                rows.append([engine, "rounding-equivalent route", route, figs["what"],
                             *(_pct(figs.get(k)) for k in ("token", "byte", "band")),
                             figs["verdict"]])
    for path in args.contrast:  # routes that change precision: how far beyond rounding
        report = json.loads(path.read_text())
        for route, entry in report["routes"].items():
            figs = figures(report, route)
            rows.append([f"{engine_of(report)} ({path.name})", "precision change, for contrast",
                         route, entry.get("description", "-"),
                         *(_pct(max((rel(b, c) for b, c in figs[k]), default=None))
                           for k in ("token", "byte", "band")),
                         entry["gates"]["ppl"]["status"]])
    rows += quoted_rows()
    timed = (f"; seconds per run: {seconds}"
             if all(None not in v for v in seconds.values()) else "")
    notes = ""
    if args.reuse:
        notes += " The runs' reports were kept by an earlier run of this script (--keep)."
    if args.contrast:
        notes += (" Contrast rows: the ppl gate's own report of a precision-changing route "
                  "(pytest --pyargs dflash_suites -m ppl --dflash-profile "
                  f"{args.profile} --dflash-route ROUTE).")
    notes += (" Rows naming another result file are recomputed from it (an H200's figures are "
              "rounded to four places: their largest value over the lowest band perplexity).")
    result = {
        "schema": "pytest-dflash/benchmark/1", "kind": "measured", "topic": "ppl tolerance",
        "title": "Rounding spread of the ppl gate's figures",
        "about": "The largest relative change of perplexity |PPL_b / PPL_a - 1| over the held-out "
                 "segments (per token, per byte) and the long contexts' position bands, between "
                 f"two runs of identical code and between routes that differ only in rounding "
                 f"({args.profile} profile, {args.runs} runs per engine{timed}). The last "
                 "column is the route's ppl gate under the policy the run used." + notes,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(), "torch": torch.__version__, "cuda": None,
        "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/ppl_spread.py", *sys.argv[1:]]),
        "values": {"columns": ["engine", "comparison", "route", "what differs", "per token",
                               "per byte", "per band", "ppl gate"], "rows": rows},
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
