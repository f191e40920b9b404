"""benchmarks/engines_side_by_side.py reads the reports of real runs on both engines: each
engine's verdict and gate figures land in that engine's column, a gate that did not run says
so, the job times give the cost ratio, and a report of the wrong engine is refused."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from benchmark_scripts import script

pytest.importorskip("transformers")

ROUTE = "prefill.geometry.fp32_q6592"


def gate_job(pytester: pytest.Pytester, name: str, *engine: str) -> tuple[Path, dict]:
    """The ppl gate of ROUTE at the quick profile (its short segments), as a job of its own:
    its report and its row of the job times (wall seconds, pytest's last line)."""
    report = pytester.path / f"{name}.json"
    start = time.perf_counter()
    result = pytester.runpytest_subprocess(
        "--pyargs", "dflash_suites.test_ppl", "-k", "heldout_segments", "--dflash-profile", "quick",
        f"--dflash-gate={ROUTE}:ppl", *engine, "--dflash-report", str(report),
        "-p", "no:cacheprovider", timeout=600)
    wall = time.perf_counter() - start
    assert report.is_file(), result.stdout.str()[-3000:]
    return report, {"name": name, "wall_s": round(wall, 1), "summary": result.outlines[-1]}


def test_both_engines_reports_side_by_side(pytester: pytest.Pytester,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from pytest_dflash.evidence.report import judged, load
    from pytest_dflash.evidence.verdict import gate_outcome

    side = script("engines_side_by_side")
    ref, ref_row = gate_job(pytester, "ref-ci")
    hf, hf_row = gate_job(pytester, "hf-ci", "--dflash-engine", "hf")
    times = pytester.path / "times.json"
    times.write_text(json.dumps([ref_row, hf_row, {**hf_row, "name": "hf-quick"}]))
    out = pytester.path / "side.json"
    args = ["--times", str(times), "--out", str(out), "--profile", "quick", "--route", ROUTE]
    assert side.main(["--reference", str(ref), "--transformers", str(hf), *args]) == 0
    data = json.loads(out.read_text())
    script("render")._check(out, data)  # a well-formed result file
    rows = {(row[0], row[1]): row[2:] for row in data["values"]["rows"]}
    figures = set()
    for column, path in enumerate((ref, hf)):
        entry = judged(load(path)["routes"])[ROUTE]
        gate = entry["gates"]["ppl"]
        assert gate["figure"], gate
        figures.add(gate["figure"])
        assert rows[(ROUTE, "ppl")][column] == f"{gate_outcome(gate)}: {gate['figure']}"
        assert rows[(ROUTE, "verdict")][column].startswith(entry["verdict"])
        assert rows[(ROUTE, "prefill")][column] == "pending: did not run"
    assert len(figures) == 2  # two models: the engines' figures differ, so columns are checked
    assert data["cost"]["hf_ci_over_main"] == [round(hf_row["wall_s"] / ref_row["wall_s"], 3)]
    assert data["cost"]["hf_quick_job_test_s"] is not None

    # the reports swapped: the reference engine's report is not the transformers engine's
    assert side.main(["--reference", str(hf), "--transformers", str(ref), *args]) == 2
    assert "not the reference engine (ReferenceEngine)" in capsys.readouterr().err
    # another profile than the reports ran
    assert side.main(["--reference", str(ref), "--transformers", str(hf), *args[:-4]]) == 2
    assert "rerun with --dflash-profile ci" in capsys.readouterr().err
