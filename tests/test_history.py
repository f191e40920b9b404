"""Run history under .dflash/, comparisons, and the `diff` / `verdict --format` commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from reportmaker import make

from pytest_dflash.evidence import history, summary
from pytest_dflash.evidence import report as reports


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_dflash.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_save_keeps_every_run_with_its_context(tmp_path: Path) -> None:
    first = reports.load(make(tmp_path / "a.json", head="1234567890abcdef"))
    second = reports.load(make(tmp_path / "b.json", speed="failed", profile="quick"))
    path_1 = history.save(first, tmp_path)
    path_2 = history.save(second, tmp_path, name="after-fix")
    assert path_1.parent == path_2.parent == tmp_path / ".dflash"
    assert path_1.name.startswith("0001_") and "_ci_cpu_1234567890" in path_1.name
    assert path_2.name.startswith("0002_")
    assert path_2.name.endswith("_quick_cpu_abc0000000_after-fix.json")
    assert reports.load(path_2)["routes"]["toy.add.fast"]["verdict"] == "reject"
    index = json.loads((tmp_path / ".dflash" / "index.json").read_text())
    assert [e["seq"] for e in index] == [1, 2]
    assert index[1]["name"] == "after-fix" and index[1]["profile"] == "quick"
    assert index[1]["device"] == "cpu (2 cores)" and index[1]["fingerprint"].startswith("abc")
    assert index[1]["verdicts"] == {"accept": 1, "reject": 1, "pending": 0}


def test_resolve_by_latest_number_name_and_path(tmp_path: Path) -> None:
    one = history.save(reports.load(make(tmp_path / "a.json")), tmp_path, name="base")
    two = history.save(reports.load(make(tmp_path / "b.json")), tmp_path)
    assert history.resolve(None, tmp_path) == two
    assert history.resolve("latest", tmp_path, exclude=two) == one
    assert history.resolve("1", tmp_path) == one
    assert history.resolve("base", tmp_path) == one
    assert history.resolve(str(tmp_path / "b.json"), tmp_path) == tmp_path / "b.json"
    with pytest.raises(history.HistoryError, match=r"'nope' is neither a report file nor a "
                                                   r"stored run; stored runs: 1 \(base"):
        history.resolve("nope", tmp_path)


def test_resolve_without_history_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(history.HistoryError, match="no runs are stored yet; save one with "
                                                   "--dflash-save"):
        history.resolve(None, tmp_path)


@pytest.mark.parametrize("name", ["", "a/b", "../up", "-x", "x" * 65, "sp ace"])
def test_bad_save_names_are_refused(tmp_path: Path, name: str) -> None:
    data = reports.load(make(tmp_path / "a.json"))
    with pytest.raises(history.HistoryError, match="a run name is 1-64 letters"):
        history.save(data, tmp_path, name=name)
    assert not list((tmp_path / ".dflash").glob("*.json")) if (tmp_path / ".dflash").exists() \
        else True


@pytest.mark.parametrize("damage", ["delete", "corrupt", "foreign"])
def test_index_is_rebuilt_from_the_stored_reports(tmp_path: Path, damage: str) -> None:
    history.save(reports.load(make(tmp_path / "a.json")), tmp_path, name="one")
    history.save(reports.load(make(tmp_path / "b.json")), tmp_path)
    index = tmp_path / ".dflash" / "index.json"
    if damage == "delete":
        index.unlink()
    else:
        index.write_text("{not json" if damage == "corrupt" else '{"a": 1}')
    listed = history.entries(tmp_path)
    assert [(e["seq"], e["name"]) for e in listed] == [(1, "one"), (2, None)]
    assert json.loads(index.read_text())[0]["name"] == "one"
    third = history.save(reports.load(make(tmp_path / "c.json")), tmp_path)
    assert third.name.startswith("0003_")


def test_compare_marks_worse_verdicts_and_gates(tmp_path: Path) -> None:
    good = reports.load(make(tmp_path / "good.json"))
    bad = reports.load(make(tmp_path / "bad.json", speed="failed", head="def"))
    result = history.compare(good, bad)
    assert result.like_for_like
    lines = result.lines()
    assert "toy.add.fast: verdict accept -> reject <- worse" in lines
    assert ("toy.add.fast speed: passed (speed passed) -> failed (speed failed) <- worse"
            in lines)
    assert "fingerprint changed: git_head" in lines
    assert lines[-1] == "got worse: 2 (toy.add.fast, toy.add.fast speed)"
    better = history.compare(bad, good)
    assert not better.worse and better.lines()[-1] == "nothing got worse"
    assert history.compare(good, good).lines() == ["no differences"]


def test_pending_after_accept_is_worse(tmp_path: Path) -> None:
    good = reports.load(make(tmp_path / "good.json"))
    pending = reports.load(make(tmp_path / "pending.json", speed=""))
    result = history.compare(good, pending)
    assert "toy.add.fast: verdict accept -> pending <- worse" in result.lines()


def test_compare_says_when_it_is_not_like_for_like(tmp_path: Path) -> None:
    cpu = reports.load(make(tmp_path / "cpu.json"))
    gpu = reports.load(make(tmp_path / "gpu.json", profile="full",
                            device={"name": "NVIDIA H200", "type": "cuda", "capability": "9.0"},
                            policy={"speed_min_gain": 0.02}))
    result = history.compare(cpu, gpu)
    assert not result.like_for_like
    assert result.lines()[0] == ("NOT LIKE FOR LIKE: device cpu (2 cores) -> NVIDIA H200; "
                                 "profile ci -> full; policy speed_min_gain 0.01 -> 0.02")


def test_compare_names_timing_shifts_beyond_the_old_interval(real_runs) -> None:
    """A real speed record (timed in worker processes) against the same record of a candidate
    made slower by more than the interval's width: the shift is named, its direction too."""
    import copy

    before = reports.load(real_runs.merged)
    after = copy.deepcopy(before)
    test = after["routes"]["attn.d256.fa2"]["gates"]["speed"]["tests"][0]
    measured = test["measurements"]
    factor = measured["ci_high"] / measured["ci_low"] * 1.05
    for key in ("ratio_median", "ci_low", "ci_high"):
        measured[key] *= factor
    lines = history.compare(before, after).lines()
    shifted = [line for line in lines if test["nodeid"] in line]
    assert len(shifted) == 1 and shifted[0].endswith("(slower)"), lines
    old = before["routes"]["attn.d256.fa2"]["gates"]["speed"]["tests"][0]["measurements"]
    assert f"ratio {old['ratio_median']:.3f} [{old['ci_low']:.3f}" in shifted[0]
    assert history.compare(after, before).lines()[-2].endswith("(faster)")
    assert history.compare(before, before).lines() == ["no differences"]


def test_diff_of_one_run_and_the_merge_of_shards(real_runs) -> None:
    """The unsharded run left the speed gate out: against the merge it is the only change."""
    done = _cli("diff", str(real_runs.unsharded), str(real_runs.merged))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "attn.d256.fa2 speed: pending (-) -> passed" in done.stdout or \
        "attn.d256.fa2 speed: pending (-) -> failed" in done.stdout
    assert "loader" not in done.stdout and "parity" not in done.stdout


def test_diff_command_exits_1_only_when_something_got_worse(tmp_path: Path) -> None:
    good = make(tmp_path / "good.json")
    bad = make(tmp_path / "bad.json", speed="failed")
    worse = _cli("diff", str(good), str(bad))
    assert worse.returncode == 1, worse.stdout
    assert "toy.add.fast: verdict accept -> reject <- worse" in worse.stdout
    better = _cli("diff", str(bad), str(good))
    assert better.returncode == 0, better.stdout
    assert _cli("diff", str(good), str(tmp_path / "missing.json")).returncode == 2


def test_markdown_summary_fits_a_pr_comment(tmp_path: Path) -> None:
    data = reports.load(make(tmp_path / "r.json", speed="failed"))
    text = summary.to_markdown(data)
    lines = text.splitlines()
    assert lines[0] == "## pytest-dflash verdicts"
    assert "**not all candidates accepted**: 1 accepted, 1 rejected, 0 pending." in lines[2]
    assert "| route | parity | speed | verdict |" in lines
    assert "| `toy.add.fast` | pass | **FAIL** | **REJECT** |" in lines
    assert "| `toy.add.slow` | pass | - | ACCEPT |" in lines
    # a | inside a figure or reason must not break the table
    assert "- `toy.add.fast`: speed failed: speed said failed \\| details" in lines
    assert "| `toy.add.slow` | parity | passed | rel L2 1e-7 \\| max abs 2e-7 |" in lines
    table_rows = [line for line in lines if line.startswith("| ")]
    assert all(line.count(" | ") + 2 == line.replace("\\|", "").count("|") for line in table_rows)


def test_json_and_text_summaries_agree_with_the_report(tmp_path: Path) -> None:
    data = reports.load(make(tmp_path / "r.json", speed=""))
    parsed = json.loads(summary.render_summary(data, "json"))
    assert parsed["schema"] == "pytest-dflash/summary/1" and parsed["accepted"] is False
    assert parsed["counts"] == {"accept": 1, "reject": 0, "pending": 1}
    fast = parsed["routes"]["toy.add.fast"]
    assert fast["verdict"] == "pending" and fast["gates"]["speed"]["status"] == "pending"
    assert fast["reasons"] == ["speed pending: did not run in this evidence"]
    text = summary.render_summary(data, "text")
    assert text.startswith("profile ci, device cpu (2 cores), fingerprint abc")
    assert "toy.add.fast" in text and "PENDING" in text
    with pytest.raises(ValueError, match="unknown summary format 'html'"):
        summary.render_summary(data, "html")


@pytest.mark.parametrize("fmt", ["text", "markdown", "json"])
def test_verdict_command_formats_keep_the_exit_status(tmp_path: Path, fmt: str) -> None:
    accepted = _cli("verdict", "--format", fmt, str(make(tmp_path / "a.json")))
    assert accepted.returncode == 0, accepted.stderr
    rejected = _cli("verdict", "--format", fmt, str(make(tmp_path / "b.json", speed="failed")))
    assert rejected.returncode == 1
    if fmt == "json":
        assert json.loads(rejected.stdout)["counts"]["reject"] == 1
    elif fmt == "markdown":
        assert "**REJECT**" in rejected.stdout
    else:
        assert "REJECT" in rejected.stdout


def test_history_command_lists_saved_runs(tmp_path: Path) -> None:
    history.save(reports.load(make(tmp_path / "a.json")), tmp_path, name="before")
    done = _cli("history", "--root", str(tmp_path))
    assert done.returncode == 0
    assert "before" in done.stdout and "accept 2 reject 0 pending 0" in done.stdout
    empty = _cli("history", "--root", str(tmp_path / "none"))
    assert "no runs stored" in empty.stdout
