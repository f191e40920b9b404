"""A toy project walks the whole evidence lifecycle through the real plugin (pytester).

pass -> accept; a gate fails -> reject naming the gate; fix + rerun that gate alone with
--dflash-merge -> accept; code changes -> merge refused; strict with nothing run -> nonzero.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from toyproject import toy_project

CONFTEST = """
from pytest_dflash import Family, Route
def pytest_dflash_routes(registry):
    registry.declare(Family("toy.add", None, baseline="toy.add.base", gates=("parity", "speed")))
    registry.register(Route("toy.add.base", "toy.add", "baseline", impl="toyimpl:base"))
    registry.register(Route("toy.add.fast", "toy.add", "candidate", baseline="toy.add.base",
                            gates=("parity", "speed"), impl="toyimpl:fast"))
"""

TOYIMPL = """
import os

def base(a, b):
    return a + b

def fast(a, b):
    # TOY_BUG stands for a broken machine state (e.g. a stale build), not a code change:
    # fixing it leaves the evidence fingerprint unchanged, so the rerun may be merged.
    return a + b + int(os.environ.get("TOY_BUG", "0")){tweak}
"""

GATES = """
import pytest
pytestmark = pytest.mark.sm70

@pytest.mark.gate("parity", family="toy.add")
def test_parity(dflash_route, dflash_registry, dflash_record):
    fast = dflash_route.implementation()
    base = dflash_registry.get(dflash_route.baseline).implementation()
    errors = [abs(fast(a, 3) - base(a, 3)) for a in range(10)]
    dflash_record(figure=f"max abs {max(errors)}", max_abs=max(errors))
    assert max(errors) == 0, f"parity broken: max abs {max(errors)}"

@pytest.mark.gate("speed", family="toy.add")
def test_speed(dflash_route, dflash_record):
    dflash_record(figure="ratio 0.50 [0.45, 0.55]", ratio_median=0.5)
"""

UNRELATED = """
def test_unrelated():
    assert True
"""

ROUTE = ["--dflash-route", "toy.add.fast", "-p", "no:cacheprovider"]


@pytest.fixture
def toy(pytester: pytest.Pytester) -> pytest.Pytester:
    return toy_project(pytester, CONFTEST, toyimpl=TOYIMPL.format(tweak=""), test_gates=GATES,
                       test_other=UNRELATED)


def _report(pytester: pytest.Pytester) -> dict:
    return json.loads((pytester.path / "dflash-report.json").read_text())


def _git(pytester: pytest.Pytester, *args: str) -> None:
    subprocess.run(["git", *args], cwd=pytester.path, check=True, capture_output=True)


def test_lifecycle_accept_reject_rerun_merge_refuse(
    toy: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _git(toy, "init", "-q")
    _git(toy, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(toy, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "toy")

    # 1. all gates pass -> accept
    result = toy.runpytest("-m", "sm70", *ROUTE)
    result.assert_outcomes(passed=2, deselected=1)
    import torch

    cuda = torch.version.cuda or "none"  # a CUDA build of torch names its CUDA on any machine
    result.stdout.fnmatch_lines([f"dflash: device cpu*capability n/a*torch 2*CUDA {cuda}*"
                                 "profile ci, fingerprint *",
                                 "*dflash verdicts*", "toy.add.fast*pass*pass*ACCEPT*"])
    report = _report(toy)
    assert report["routes"]["toy.add.fast"]["verdict"] == "accept"
    assert report["fingerprint"]["git_head"]

    # 2. a gate fails -> reject, and the failing gate is named with its figure
    monkeypatch.setenv("TOY_BUG", "1")
    result = toy.runpytest("-m", "sm70", *ROUTE)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["toy.add.fast*FAIL*pass*REJECT*", "*parity: max abs 1*",
                                 "*parity failed: *parity broken*"])
    report = _report(toy)
    entry = report["routes"]["toy.add.fast"]
    assert entry["verdict"] == "reject"
    assert entry["gates"]["parity"]["status"] == "failed"
    assert entry["gates"]["speed"]["status"] == "passed"

    # 3. fix, rerun only that gate, merge -> accept; the speed evidence is kept, not rerun
    monkeypatch.delenv("TOY_BUG")
    result = toy.runpytest("--dflash-gate", "toy.add.fast:parity", "--dflash-merge",
                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, deselected=2)
    assert result.ret == pytest.ExitCode.OK
    report = _report(toy)
    entry = report["routes"]["toy.add.fast"]
    assert entry["verdict"] == "accept", entry["reasons"]
    assert [t["outcome"] for t in entry["gates"]["speed"]["tests"]] == ["passed"]
    assert len(entry["gates"]["parity"]["tests"]) == 1

    # 4. the code changes (a tracked file differs from HEAD) -> merge refused, report untouched
    before = (toy.path / "dflash-report.json").read_text()
    (toy.path / "toyimpl.py").write_text(TOYIMPL.format(tweak="  # tweaked"))
    result = toy.runpytest("--dflash-gate", "toy.add.fast:parity", "--dflash-merge",
                           "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*merge refused*git_dirty_sha256*"])
    assert (toy.path / "dflash-report.json").read_text() == before


def test_evidence_of_another_engine_or_dtype_never_merges(toy: pytest.Pytester) -> None:
    """The engine that computed the evidence is part of the fingerprint: a bfloat16 run of the
    transformers engine does not merge into a report the reference engine wrote."""
    pytest.importorskip("transformers")
    _git(toy, "init", "-q")
    _git(toy, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(toy, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "toy")
    assert toy.runpytest("-m", "sm70", *ROUTE).ret == pytest.ExitCode.OK
    assert _report(toy)["fingerprint"]["engine"] == "reference"
    before = (toy.path / "dflash-report.json").read_text()
    result = toy.runpytest_subprocess("--dflash-gate", "toy.add.fast:parity", "--dflash-merge",
                                      "--dflash-engine", "hf", "--dflash-dtype", "bfloat16",
                                      "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*merge refused*(changed: engine)*"])
    assert (toy.path / "dflash-report.json").read_text() == before


def test_strict_fails_when_selected_candidate_is_pending(toy: pytest.Pytester) -> None:
    result = toy.runpytest("--dflash-strict", "-k", "unrelated", *ROUTE)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*strict mode: selected candidates left pending: toy.add.fast*"])
    assert _report(toy)["routes"]["toy.add.fast"]["verdict"] == "pending"


def test_without_strict_pending_is_reported_but_not_fatal(toy: pytest.Pytester) -> None:
    result = toy.runpytest("-k", "unrelated", *ROUTE)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["toy.add.fast*pending*pending*PENDING*",
                                 "*parity pending: did not run*"])


def test_skipped_gate_is_pending_never_passed(toy: pytest.Pytester) -> None:
    toy.makepyfile(test_gates=GATES.replace(
        'def test_speed(dflash_route, dflash_record):',
        '@pytest.mark.requires_sm70\ndef test_speed(dflash_route, dflash_record):'))
    result = toy.runpytest("-m", "sm70", *ROUTE)
    result.assert_outcomes(passed=1, skipped=1, deselected=1)
    entry = _report(toy)["routes"]["toy.add.fast"]
    assert entry["gates"]["speed"]["status"] == "pending"
    assert entry["verdict"] == "pending"
    assert "requires SM70 hardware" in entry["reasons"][0]


def test_report_is_written_when_interrupted(toy: pytest.Pytester) -> None:
    toy.makepyfile(test_gates=GATES.replace(
        'dflash_record(figure="ratio 0.50 [0.45, 0.55]", ratio_median=0.5)',
        'raise KeyboardInterrupt'))
    result = toy.runpytest_subprocess("-m", "sm70", *ROUTE)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    report = _report(toy)
    assert report["session"]["interrupted"] is True
    entry = report["routes"]["toy.add.fast"]
    assert entry["gates"]["parity"]["status"] == "passed"
    # the test the session stopped in had passed its setup only: never a pass
    stopped = entry["gates"]["speed"]
    assert stopped["status"] == "pending"
    assert [t["outcome"] for t in stopped["tests"]] == ["interrupted"]
    assert entry["verdict"] == "pending"
    assert any("did not finish: the session stopped while it ran" in r for r in entry["reasons"])


def test_unrelated_run_writes_no_report(toy: pytest.Pytester) -> None:
    result = toy.runpytest("-k", "unrelated", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, deselected=2)
    assert not (toy.path / "dflash-report.json").exists()


def test_xdist_two_workers_one_merged_report_and_speed_refused(toy: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    result = toy.runpytest_subprocess("-n", "2", "-m", "sm70", *ROUTE)
    result.assert_outcomes(passed=1, skipped=1)
    entry = _report(toy)["routes"]["toy.add.fast"]
    assert entry["gates"]["parity"]["status"] == "passed"
    speed = entry["gates"]["speed"]
    assert speed["status"] == "pending"
    assert "never share the device with parallel workers" in speed["tests"][0]["message"]


def test_policy_override_from_pyproject_is_echoed(toy: pytest.Pytester) -> None:
    toy.makefile(".toml", pyproject="[tool.pytest-dflash]\nppl_rel_tolerance = 0.02\n")
    toy.runpytest("-m", "sm70", *ROUTE).assert_outcomes(passed=2, deselected=1)
    policy = _report(toy)["policy"]
    assert policy["ppl_rel_tolerance"] == 0.02
    assert policy["validation_noise_floor"] == 0.01
    assert policy["output_contract"]["max_same_token_run"] == 48


def test_policy_unknown_key_is_a_usage_error(toy: pytest.Pytester) -> None:
    toy.makefile(".toml", pyproject="[tool.pytest-dflash]\nppl_tolerence = 0.02\n")
    result = toy.runpytest(*ROUTE)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown threshold 'ppl_tolerence'*ppl_rel_tolerance*"])


def test_policy_override_in_the_old_absolute_ppl_unit_is_refused(toy: pytest.Pytester) -> None:
    """An absolute perplexity tolerance read as a relative one would silently mean 100x more."""
    toy.makefile(".toml", pyproject="[tool.pytest-dflash]\nppl_tolerance = 0.01\n")
    result = toy.runpytest(*ROUTE)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ppl_tolerance: it was an absolute perplexity difference*"
                                 "set ppl_rel_tolerance instead*"])


def test_policy_quality_batch_below_one_is_a_usage_error(toy: pytest.Pytester) -> None:
    toy.makefile(".toml", pyproject="[tool.pytest-dflash]\nquality_batch = 0\n")
    result = toy.runpytest(*ROUTE)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*quality_batch must be >= 1*got 0*quality_batch = 1 or more*"])


def test_merge_into_a_corrupt_report_is_refused_and_keeps_the_file(toy: pytest.Pytester) -> None:
    (toy.path / "dflash-report.json").write_text('{"schema": "pytest-dflash/report/3", "rou')
    result = toy.runpytest("-m", "sm70", "--dflash-merge", *ROUTE)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*corrupt report, not valid JSON*left unchanged*"])
    assert (toy.path / "dflash-report.json").read_text().endswith('"rou')
