"""Result files from the reports of a GPU job (``benchmarks/gpu_job.sh``).

The job leaves, in one folder, ``env.json`` (card, driver, torch, CUDA, library versions),
``stages.log`` (each stage's exit status and wall seconds) and the reports it wrote. This turns
them into result files under ``benchmarks/results/`` (schema in ``benchmarks/render.py``), each
naming the card, torch, CUDA and the commit the job ran:

    python benchmarks/gpu_results.py FOLDER --commit HASH[,HASH] [--date YYYY-MM-DD] [--note TEXT]

* ``<card>-main-job-full.json``: the full-profile main job, one row per route and gate
  (status, seconds, figure), with the test seconds and the report's size in ``about``;
* ``<card>-transformers-engine.json``: every route of each ``--dflash-engine hf`` run
  (``hf*-ci.json``: the shipped candidates and the kernel libraries' routes inside the Qwen3.5
  hybrid), one row per gate, with the run's compute dtype;
* ``<card>-library-routes.json``: the kernel libraries' routes alone, one row per route with
  its verdict and each gate's figure (docs/library-routes.md);
* ``<card>-selftest-quick.json``: the quick self-test's catch table and its seconds;
* ``<card>-hf-selftest.json``: the planted defects of linear.gdn.fla_chunk, caught or not;
* ``<card>-prefill-graph.json``: eager cold prefills against graph replays of them
  (``benchmarks/prefill_graph.py``);
* ``<card>-timing-aa-validation-cost.json``: the A/A and planted-slowdown counts of every
  ``aa*.run*.json``.

``--note TEXT`` adds a sentence to every file's ``about``: which runs came from which call or
commit, when a folder joins the reports of several.

A stage whose report is missing writes no file; the script says which.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pytest_dflash.evidence import catch  # noqa: E402
from pytest_dflash.evidence import report as reports  # noqa: E402
from pytest_dflash.evidence.verdict import gate_figure, gate_status  # noqa: E402
from pytest_dflash.routes.library import CANDIDATES  # noqa: E402
from pytest_dflash.selftest import repeat  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = "pytest-dflash/benchmark/1"


def card_slug(card: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "h100": the result files' prefix."""
    found = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", card)
    return found.group(1).lower() if found else re.sub(r"\W+", "-", card.lower()).strip("-")


def stages(folder: Path) -> dict[str, dict[str, float]]:
    """``{stage: {"rc": int, "seconds": float}}`` from stages.log (the last line of a stage)."""
    out: dict[str, dict[str, float]] = {}
    log = folder / "stages.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        m = re.match(r"(\w+) rc=(\d+) seconds=([\d.]+)", line)
        if m:
            out[m.group(1)] = {"rc": int(m.group(2)), "seconds": float(m.group(3))}
    return out


def header(env: Mapping[str, Any], *, topic: str, title: str, about: str, command: str,
           commit: str | list[str], date: str, note: str = "") -> dict[str, Any]:
    libs = ", ".join(f"{k} {env[k]}" for k in ("transformers", "triton", "fla", "liger_kernel")
                     if k in env and not str(env[k]).startswith("not importable"))
    return {"schema": SCHEMA, "kind": "measured", "topic": topic, "title": title,
            "about": f"{about} {note}".strip(),
            "machine": f"one {env['card']} (capability {env['capability']}), driver "
                       f"{env.get('driver', '?')}, {env.get('cpus', '?')} CPU cores"
                       + (f"; {libs}" if libs else ""),
            "python": env["python"], "torch": env["torch"], "cuda": env["cuda"],
            "commit": commit, "date": date, "command": command}


def figure_of(tests: list[Mapping[str, Any]], limit: int = 2) -> str:
    """The gate's figure, else the first message of a test that failed or erred before it
    measured, else of one that was skipped (a pending gate's reason): a row never reads
    blank."""
    figure = gate_figure(tests, limit=limit)
    if figure:
        return figure
    for outcomes in (("failed", "error"), ("skipped", "inconclusive")):
        for test in tests:
            if test.get("outcome") in outcomes and test.get("message"):
                return test["message"].splitlines()[0][:200]
    return ""


def gate_rows(report: Mapping[str, Any], routes: list[str] | None = None) -> list[list[Any]]:
    """route, gate, status, seconds (its tests' duration), figure: one row per required gate."""
    rows = []
    for name, entry in sorted(report["routes"].items()):
        if routes is not None and name not in routes:
            continue
        if entry.get("planted") or entry.get("role") != "candidate":
            continue
        for kind in entry.get("required", []):
            gate = entry.get("gates", {}).get(kind) or {}
            tests = gate.get("tests", [])
            seconds = round(sum(t.get("duration_s") or 0 for t in tests), 1)
            status = gate_status(tests) if tests else "pending"
            figure = figure_of(tests) if tests else "did not run"
            rows.append([name, kind, status, seconds, figure])
    return rows


def verdict_rows(report: Mapping[str, Any], routes: list[str]) -> list[list[Any]]:
    """route, verdict, then each gate as 'status: figure' (library routes' page)."""
    rows = []
    for name in routes:
        entry = report["routes"].get(name)
        if entry is None:
            rows.append([name, "not registered", ""])
            continue
        parts = []
        for kind in entry.get("required", []):
            tests = (entry.get("gates", {}).get(kind) or {}).get("tests", [])
            status = gate_status(tests) if tests else "pending"
            parts.append(f"{kind} {status}: {figure_of(tests, limit=1) if tests else '-'}")
        rows.append([name, entry.get("verdict", "?"), " | ".join(parts)])
    return rows


def compute_dtype(report: Mapping[str, Any], folder: Path, stage: str) -> str:
    """The transformers engine's compute dtype of a run: from the report's fingerprint, else
    (a report from before the engine was fingerprinted) from the stage's command line."""
    engine = str(report.get("fingerprint", {}).get("engine") or "")
    if engine.startswith("transformers "):
        return engine.rsplit(" ", 1)[-1]
    log = folder / "stages.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        if line.startswith(f"== {stage}: "):
            found = re.search(r"--dflash-dtype[ =](\w+)", line)
            return found.group(1) if found else "float32"
    return "float32"


def tests_of(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Every gate test of every route in ``report``."""
    return [t for e in report["routes"].values() for g in e.get("gates", {}).values()
            for t in g.get("tests", [])]


def test_seconds(report: Mapping[str, Any]) -> float:
    return round(sum(t.get("duration_s") or 0 for t in tests_of(report)), 1)


def write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--note", default="",
                        help="a sentence added to every result file's about (e.g. which runs "
                             "came from which commit)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where the result files go (default benchmarks/results)")
    args = parser.parse_args(argv)
    results: Path = args.results
    folder: Path = args.folder
    env = json.loads((folder / "env.json").read_text())
    slug, walls = card_slug(env["card"]), stages(folder)
    # runs of one folder made on different commits: --commit A,B (the result file lists both)
    commits = args.commit.split(",")
    common = {"commit": commits if len(commits) > 1 else commits[0], "date": args.date,
              "note": args.note}

    main_report = folder / "main-full.json"
    if main_report.exists():
        rep = reports.load(main_report)
        size = main_report.stat().st_size
        wall = walls.get("main", {})
        counts: dict[str, int] = {}
        for t in tests_of(rep):
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        about = (f"The main job on one GPU, full profile: {test_seconds(rep)} s of tests "
                 f"({wall.get('seconds', '?')} s wall for the whole pytest process, exit "
                 f"{wall.get('rc', '?')}), outcomes {json.dumps(counts, sort_keys=True)}. Its "
                 f"report is {size:,} bytes ({size / 2**20:.2f} MiB). Native libraries built "
                 "beforehand (pytest-dflash build). One row per route and gate: the status, "
                 "the seconds of its tests and its figure.")
        write(results / f"{slug}-main-job-full.json", {
            **header(env, topic="main job", title=f"Full-profile main job on one {env['card']}",
                     about=about, command="pytest -m sm70 --dflash-device cuda "
                     "--dflash-profile full --dflash-report main-full.json", **common),
            "values": {"columns": ["route", "gate", "status", "seconds", "figure"],
                       "rows": gate_rows(rep)}})
    else:
        print("no main-full.json: main job result not written")

    hf_reports = sorted(folder.glob("hf*-ci.json"))
    if hf_reports:
        engine_rows: list[list[Any]] = []
        library_rows: list[list[Any]] = []
        names = [route.name for route in CANDIDATES]
        runs = []
        for path in hf_reports:
            rep = reports.load(path)
            stage = path.name.removesuffix("-ci.json")
            dtype = compute_dtype(rep, folder, stage)
            wall = walls.get(stage, {})
            runs.append(f"{stage}: {dtype}, {test_seconds(rep)} s of tests "
                        f"({wall.get('seconds', '?')} s wall, exit {wall.get('rc', '?')})")
            engine_rows += [[row[0], dtype, *row[1:]] for row in gate_rows(rep)]
            library_rows += [[row[0], dtype, *row[1:]] for row in
                             verdict_rows(rep, [n for n in names if n in rep["routes"]])]
        about = (f"pytest -m sm70 --dflash-engine hf on the GPU, ci profile, with the "
                 f"gpu-routes extra, inside the tiny Qwen3.5-architecture hybrid shipped with "
                 f"the package, transformers {env.get('transformers')}; one pytest run per "
                 f"compute dtype ({'; '.join(runs)}).")
        write(results / f"{slug}-transformers-engine.json", {
            **header(env, topic="transformers engine",
                     title=f"Routes inside the Qwen3.5 hybrid on one {env['card']}",
                     about=about, command="pytest -m sm70 --dflash-device cuda --dflash-engine "
                     "hf --dflash-profile ci [--dflash-dtype bfloat16] --dflash-route ...",
                     **common),
            "values": {"columns": ["route", "dtype", "gate", "status", "seconds", "figure"],
                       "rows": engine_rows}})
        if library_rows:
            write(results / f"{slug}-library-routes.json", {
                **header(env, topic="kernel libraries",
                         title=f"Kernel libraries as routes on one {env['card']}",
                         about="The verdict of each kernel library's route inside the Qwen3.5 "
                               "hybrid, with each required gate's status and figure (ci "
                               f"profile; transformers {env.get('transformers')}, fla-core "
                               f"{env.get('fla')}, liger-kernel {env.get('liger_kernel')}), "
                               "in the compute dtype of its run.",
                         command="pip install 'pytest-dflash[hf,gpu-routes]' && pytest -m sm70 "
                                 "--dflash-device cuda --dflash-engine hf --dflash-profile ci "
                                 "[--dflash-dtype bfloat16]", **common),
                "values": {"columns": ["route", "dtype", "verdict", "gates"],
                           "rows": library_rows}})
    else:
        print("no hf*-ci.json: transformers engine results not written")

    for stem, stage, title, command in (
            ("selftest-quick", "selftest", "Quick self-test",
             "pytest-dflash selftest selftest-quick.json --run --dflash-profile quick "
             "--dflash-device cuda"),
            ("hf-selftest", "hfselftest", "Planted defects of linear.gdn.fla_chunk inside the "
             "Qwen3.5 hybrid", "pytest-dflash selftest hf-selftest.json --run --dflash-engine hf "
             "--dflash-device cuda --dflash-profile quick --dflash-route linear.gdn.fla_chunk")):
        path = folder / f"{stem}.json"
        if not path.exists():
            print(f"no {path.name}: its result not written")
            continue
        rep = reports.load(path)
        section = catch.summarize(rep)
        wall = walls.get(stage, {})
        rows = []
        for route, kinds in sorted(section["routes"].items()):
            for kind, s in sorted(kinds.items()):
                copy = (s.get("copy") or {}).get("status", "-")
                caught = "; ".join(f"{d['key']} {d['status']}" for d in s["defects"]) or "-"
                rows.append([route, kind, s["route_status"], copy,
                             f"{s['caught']}/{s['planted']}", caught])
        about = (f"{command.split(' --run')[0].split(' ')[0]} --run on the GPU: "
                 f"{test_seconds(rep)} s of tests, {wall.get('seconds', '?')} s wall (exit "
                 f"{wall.get('rc', '?')}). Per route and gate: the route's own status, its "
                 "unchanged copy's, and each planted defect: caught (failed, or inconclusive "
                 "for a timing gate) or missed (passed).")
        write(results / f"{slug}-{stem}.json", {
            **header(env, topic="self-test", title=f"{title} on one {env['card']}",
                     about=about, command=command, **common),
            "values": {"columns": ["route", "gate", "route status", "unchanged copy",
                                   "caught", "planted defects"], "rows": rows}})

    graph_path = folder / "prefill-graph.json"
    if graph_path.exists():
        bench = json.loads(graph_path.read_text())
        rows = [[r["length"], r["route"], r.get("chunks"), r["eager_s"], r.get("replay_s"),
                 r.get("host_share"), r.get("capture_s"),
                 r.get("same_hash") if "refused" not in r else f"refused: {r['refused']}"]
                for r in bench["rows"]]
        write(results / f"{slug}-prefill-graph.json", {
            **header(env, topic="prefill timing",
                     title=f"Cold prefill, eager and as one CUDA graph replay, on one "
                           f"{env['card']}",
                     about="The reference engine's cold prefill at the full profile's lengths "
                           "(the baseline engine, then each candidate switched in): the median "
                           f"of {bench['runs']} eager prefills (wall time, device synchronized) "
                           "and of as many replays of the same prefill captured in one CUDA "
                           "graph (CUDA events, L2 flushed before each), the share of the "
                           "eager time that the replay does not spend (the host launching "
                           "kernels), the seconds of the capture, and whether the replay's "
                           "first-token hash is the eager prefill's.",
                     command="python benchmarks/prefill_graph.py --out prefill-graph.json "
                             "--runs 3", **common),
            "values": {"columns": ["tokens", "engine", "chunks", "eager s", "replay s",
                                   "host share", "capture s", "same hash"], "rows": rows}})
    else:
        print("no prefill-graph.json: prefill graph result not written")

    runs = sorted(folder.glob("aa*.run*.json"))
    runs = [p for p in runs if not p.name.endswith(".repeat.json")]
    if runs:
        section = repeat.tally([reports.load(p) for p in runs])
        rows = []
        for route, kinds in sorted(section["routes"].items()):
            for kind, keys in sorted(kinds.items()):
                for key in sorted(keys, key=repeat._order):
                    c = keys[key]
                    rows.append([route, kind, key, sum(c.values()), c["pass"],
                                 c["inconclusive"], c["fail"], c["error"] + c["pending"]])
        write(results / f"{slug}-timing-aa-validation-cost.json", {
            **header(env, topic="timing error rates",
                     title=f"A/A control and planted slowdowns over {len(runs)} runs "
                           f"(full profile, {env['card']})",
                     about="pytest-dflash selftest --repeat on gemm.nvfp4.qpn2_packed's "
                           "op-level validation_cost gate (verify M = 1..8): its unchanged "
                           "copy (an A/A control) and its verify step slowed by 2% and 5%, "
                           "each run its own pytest process with its own timing workers, "
                           "CUDA-graph replays timed with events; a process's statistic is "
                           "the interquartile mean of its rounds.",
                     command="pytest-dflash selftest aa.json --repeat 10 --run --dflash-route "
                             "gemm.nvfp4.qpn2_packed --dflash-device cuda --dflash-profile full "
                             "-k \"validation_cost_verify_m and (copy or verify_cost_2pct or "
                             "verify_cost_5pct)\"", **common),
            "values": {"columns": ["route", "gate", "planted", "runs", "pass", "inconclusive",
                                   "fail", "other"], "rows": rows}})
    else:
        print("no aa*.run*.json: A/A result not written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
