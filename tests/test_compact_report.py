"""The report's compact form (``pytest_dflash.evidence.compact``): each timing process keeps its
summary of every round and a bounded, evenly spaced sample of its rounds; reports are compact
JSON, or gzip for a ``.json.gz`` path. The readers are tested on reports real runs wrote
(``real_runs`` in conftest.py, whose shards keep 3 rounds a process)."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import reportmaker
from benchmark_scripts import script

from pytest_dflash.evidence import compact, timings
from pytest_dflash.evidence import report as reports
from pytest_dflash.measure.process_statistics import ProcessSample, process_statistic


def _process(rounds: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    base = rng.uniform(1e-3, 2e-3, rounds)
    cand = base * rng.lognormal(0.0, 0.05, rounds)
    sample = ProcessSample(worker=seed, pid=100 + seed, candidate_s=cand.tolist(),
                           baseline_s=base.tolist(), orders=["cb", "bc"] * (rounds // 2))
    return sample.as_json()


def _comparison(rounds: int, processes: int = 3) -> dict:
    return {"figure": "ratio 1.0", "threshold": 1.01, "ci_low": 0.99, "ci_high": 1.01,
            "unit": "process", "processes": [_process(rounds, s) for s in range(processes)]}


def test_each_process_keeps_a_summary_of_every_round_and_a_bounded_sample() -> None:
    full = _comparison(1000)
    kept = compact.measurements(full, keep=32)
    for before, after in zip(full["processes"], kept["processes"], strict=True):
        cand, base = before["samples"]["candidate"], before["samples"]["baseline"]
        ratios = np.asarray(cand) / np.asarray(base)
        summary = after["summary"]
        assert summary["count"] == 1000
        assert summary["ratio"]["iqm"] == pytest.approx(math.exp(process_statistic(ratios)))
        assert summary["ratio"]["iqm"] == pytest.approx(before["ratio"])
        for name, q in (("q1", 25), ("median", 50), ("q3", 75)):
            assert summary["ratio"][name] == pytest.approx(np.percentile(ratios, q))
            assert summary["candidate_s"][name] == pytest.approx(np.percentile(cand, q))
        assert summary["baseline_s"]["total"] == pytest.approx(sum(base))
        index = after["sampled"]["rounds"]
        assert after["sampled"]["of"] == 1000 and len(index) == 32
        assert index[0] == 0 and index[-1] == 999 and index == sorted(set(index))
        # a kept round keeps both sides of the same round, and its order
        assert after["samples"]["candidate"] == [cand[i] for i in index]
        assert after["samples"]["baseline"] == [base[i] for i in index]
        assert after["orders"] == [before["orders"][i] for i in index]
        # the statistic the interval was computed from is untouched
        assert after["statistic"] == before["statistic"] and after["rounds"] == 1000


def test_validation_cost_widths_are_compacted_where_they_nest() -> None:
    measured = {"figure": "worst M=4", "per_m": {f"m{m}": _comparison(200, 2)
                                                 for m in range(1, 9)}}
    kept = compact.measurements(measured, keep=16)
    found = list(timings.comparisons(kept))
    assert [label for label, _ in found] == [f"verify M={m}" for m in range(1, 9)]
    for _, series in found:
        assert all(len(p["samples"]["candidate"]) == 16 and p["summary"]["count"] == 200
                   for p in series["processes"])
    # the readers' per-process view shows the kept rounds' ratios next to the full statistic
    procs = timings.processes(found[0][1])
    assert len(procs[0]["rounds"]) == 16
    assert procs[0]["ratio"] == pytest.approx(measured["per_m"]["m1"]["processes"][0]["ratio"])


def test_the_round_protocol_is_kept_the_same_way_at_its_top() -> None:
    rng = np.random.default_rng(3)
    base = rng.uniform(1.0, 2.0, 100).tolist()
    measured = {"threshold": 0.99, "rounds": 100, "ci_low": 0.9, "ci_high": 0.95,
                "orders": ["cb"] * 100,
                "samples": {"candidate": [b * 0.9 for b in base], "baseline": base}}
    kept = compact.measurements(measured, keep=10)
    assert timings.protocol(kept) == timings.ROUND
    assert len(kept["samples"]["baseline"]) == 10 and kept["sampled"]["of"] == 100
    assert kept["summary"]["ratio"]["median"] == pytest.approx(0.9)
    assert timings.units(kept) == 100  # the interval rests on every round, not the sample


def test_compaction_is_idempotent_and_all_keeps_every_round() -> None:
    full = _comparison(300)
    once = compact.measurements(full, keep=8)
    assert compact.measurements(once, keep=8) == once
    assert compact.measurements(once, keep=4) == once  # a sample is never resampled
    every = compact.measurements(full, keep=None)
    assert every["processes"][0]["samples"] == full["processes"][0]["samples"]
    assert "sampled" not in every["processes"][0]
    assert every["processes"][0]["summary"]["count"] == 300
    small = compact.measurements(_comparison(20), keep=32)  # fewer rounds than kept: all kept
    assert len(small["processes"][0]["samples"]["candidate"]) == 20
    assert "sampled" not in small["processes"][0]


@pytest.mark.parametrize("value", ["0", "1", "-3", "many", "2.5"])
def test_a_bad_rounds_setting_names_the_value_and_the_fix(value: str) -> None:
    with pytest.raises(ValueError, match=r"dflash_report_rounds = .*at least 2.*'all'"):
        compact.parse_keep(value)


def test_rounds_setting_values() -> None:
    assert compact.parse_keep(None) == compact.DEFAULT_KEEP
    assert compact.parse_keep("") == compact.DEFAULT_KEEP
    assert compact.parse_keep("ALL") is None
    assert compact.parse_keep("12") == 12


def test_a_bad_rounds_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest("--dflash-report-rounds=1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*dflash_report_rounds = '1'*at least 2*"])


def test_a_report_is_compact_json_and_a_gz_path_is_gzip(tmp_path: Path) -> None:
    plain = reportmaker.make(tmp_path / "r.json")
    text = plain.read_text(encoding="utf-8")
    assert text.count("\n") == 1 and ", " not in text.split('"message"')[0]
    zipped = tmp_path / "r.json.gz"
    reports.write_atomic(reports.load(plain), zipped)
    assert json.loads(gzip.decompress(zipped.read_bytes())) == json.loads(text)
    assert reports.load(zipped)["routes"] == reports.load(plain)["routes"]
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(b"{not gzip")
    with pytest.raises(reports.ReportError, match="broken.json.gz: cannot read report"):
        reports.load(broken)


# ------------------------------------------------------------------ on reports real runs wrote


def _timing_tests(report: dict) -> list[dict]:
    return [test for entry in report["routes"].values() for gate in entry["gates"].values()
            for test in gate["tests"] if timings.worst(test["measurements"]) is not None]


def test_a_real_run_keeps_the_sample_and_the_summary(real_runs) -> None:
    report = reports.load(real_runs.merged)
    found = _timing_tests(report)
    assert found, "the real selection has a speed gate timed in worker processes"
    for test in found:
        for _, series in timings.comparisons(test["measurements"]):
            assert timings.protocol(series) == timings.PROCESS
            for proc in series["processes"]:
                assert len(proc["samples"]["candidate"]) == 3  # first, middle and last round
                assert proc["summary"]["count"] == proc["rounds"]
                assert proc["summary"]["ratio"]["iqm"] == pytest.approx(proc["ratio"])
                # every process times at least 4 rounds (timing_min_rounds_per_process)
                assert proc["sampled"] == {"rounds": [0, round((proc["rounds"] - 1) / 2),
                                                      proc["rounds"] - 1],
                                           "of": proc["rounds"]}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_dflash.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_every_cli_reader_reads_a_real_compact_report_also_gzipped(real_runs,
                                                                   tmp_path: Path) -> None:
    zipped = tmp_path / "all.json.gz"
    reports.write_atomic(reports.load(real_runs.merged), zipped)
    assert zipped.stat().st_size < real_runs.merged.stat().st_size
    for path in (real_runs.merged, zipped):
        verdict = _cli("verdict", str(path))
        assert verdict.returncode in (0, 1), verdict.stderr
        assert "attn.d256.fa2" in verdict.stdout
        diff = _cli("diff", str(real_runs.shards[0]), str(path))
        assert diff.returncode in (0, 1), diff.stderr
        enable = _cli("enable", str(path))
        assert enable.returncode in (0, 1), enable.stderr
        plotted = _cli("plot", str(path), "-o", str(tmp_path / f"plots-{path.name}"))
        assert plotted.returncode == 0, plotted.stderr
        assert list((tmp_path / f"plots-{path.name}").glob("*.png"))
        merged = tmp_path / f"again-{path.name}"
        redo = _cli("merge", str(merged), *map(str, real_runs.shards))
        assert redo.returncode == 0, redo.stderr
        assert reports.load(merged)["routes"] == reports.load(real_runs.merged)["routes"]


def test_replays_read_every_round_or_name_the_option_that_keeps_them() -> None:
    full = _comparison(100)["processes"][0]
    cand, base, orders = compact.every_round(full)
    assert cand == full["samples"]["candidate"] and orders == full["orders"]
    kept = compact.measurements(_comparison(100), keep=8)["processes"][0]
    with pytest.raises(ValueError, match="keeps 8 of 100 rounds.*--dflash-report-rounds all"):
        compact.every_round(kept)
    # the seconds a process timed come from the summary of every round, not the sample
    assert compact.timed_seconds(kept) == pytest.approx(sum(cand) + sum(base))
    assert compact.timed_seconds(full) == pytest.approx(sum(cand) + sum(base))
    # a CPU sample of a short call is the mean of calls_per_sample calls: each cost them all
    kept["info"] = {**(kept.get("info") or {}), "calls_per_sample": 9}
    assert compact.timed_seconds(kept) == pytest.approx(9 * (sum(cand) + sum(base)))


def test_the_size_script_reads_real_reports(real_runs, tmp_path: Path) -> None:
    """benchmarks/report_size.py on reports a real run wrote: every timing process is counted,
    and the compacted form of evidence that is compact already is no bigger than the file."""
    size = script("report_size")
    out = tmp_path / "sizes.json"
    assert size.main([str(real_runs.merged), "--label", "merged", "--out", str(out),
                      "--machine", "m", "--commit", "c", "--command", "x", "--about", "a"]) == 0
    (row,) = json.loads(out.read_text())["values"]["rows"]
    written, whole, compacted, zipped, procs, timed, kept = row[3:]
    assert written == real_runs.merged.stat().st_size
    assert whole == ""  # the shards kept a sample: the form with every round cannot be had
    assert zipped < compacted <= written + 16
    report = reports.load(real_runs.merged)
    series = [s for t in _timing_tests(report) for _, s in timings.comparisons(t["measurements"])]
    assert procs == sum(len(s["processes"]) for s in series) > 0
    assert timed == sum(p["rounds"] for s in series for p in s["processes"]) and kept == 3 * procs


def test_the_size_script_compares_every_round_with_the_compact_form(tmp_path: Path) -> None:
    """A report that kept every round (``--dflash-report-rounds all``) gets the old form's size
    beside the compacted one; the compacted one keeps 32 rounds a process."""
    path = reportmaker.make(tmp_path / "all.json", speed_measurements=_comparison(1000, 6))
    out = tmp_path / "sizes.json"
    assert script("report_size").main([str(path), "--label", "all", "--out", str(out),
                                       "--machine", "m", "--commit", "c", "--command", "x",
                                       "--about", "a"]) == 0
    (row,) = json.loads(out.read_text())["values"]["rows"]
    written, whole, compacted, zipped, procs, timed, kept = row[3:]
    assert (procs, timed, kept) == (6, 6000, 6000)
    assert whole > written > 10 * compacted > 10 * zipped
