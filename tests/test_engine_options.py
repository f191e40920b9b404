"""Engine options are checked when the session starts: every bad value is a usage error that
names the problem and the fix, before any test or server runs."""

from __future__ import annotations

import json

import pytest

from pytest_dflash.engines import Capabilities, missing
from pytest_dflash.policy.thresholds import Policy

# imported once here: pytester's in-process runs drop modules they import, and datasets
# cannot be imported twice in one process (pyarrow extension types are registered globally)
pytest.importorskip("datasets")


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_a="def test_a():\n    assert True\n")
    return pytester


@pytest.mark.parametrize("args, words", [
    (["--dflash-serve", "vllm serve m --port 8000"], "*must contain {port}*"),
    (["--dflash-serve", "x {port}", "--dflash-engine-url", "baseline=http://h:1"],
     "*give one of them*"),
    (["--dflash-engine-url", "baseline"], "*must look like KEY=http://HOST:PORT*"),
    (["--dflash-engine-url", "baseline=http://a:1", "--dflash-engine-url",
      "baseline=http://b:2"], "*names 'baseline' twice*"),
    (["--dflash-serve-timeout", "0"], "*must be > 0 seconds*"),
    (["--dflash-serve", "x {port}", "-n", "2"], "*cannot run under pytest -n*"),
    (["--dflash-data", "no/such/dir"], "*no/such/dir: no such directory*"),
])
def test_bad_engine_options_are_usage_errors(project: pytest.Pytester, args: list[str],
                                             words: str) -> None:
    result = project.runpytest(*args, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([words])


@pytest.mark.parametrize("lines, words", [
    (['{"id": "a", "text": "x"}', "not json"], "*ppl_segments.jsonl line 2: not JSON*"),
    (['{"id": "a"}'], "*line 1: key 'text' must be a non-empty string*"),
    (['{"id": "a", "text": "x"}', '{"id": "a", "text": "y"}'], "*id 'a' appears twice*"),
    (['["id", "text"]'], "*a JSON list, expected an object*"),
    ([""], "*ppl_segments.jsonl: no rows*"),
])
def test_bad_data_override_names_file_line_and_fix(project: pytest.Pytester, lines: list[str],
                                                   words: str) -> None:
    data = project.mkdir("data")
    (data / "ppl_segments.jsonl").write_text("\n".join(lines) + "\n")
    result = project.runpytest("--dflash-data", str(data), "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([words])


def test_data_directory_without_any_data_file_is_refused(project: pytest.Pytester) -> None:
    project.mkdir("empty")
    result = project.runpytest("--dflash-data", "empty", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*holds none of ppl_segments.jsonl, long_contexts.jsonl, "
                                 "coding_tasks.jsonl*"])


def test_data_override_feeds_the_ppl_gate(pytester: pytest.Pytester) -> None:
    data = pytester.mkdir("mydata")
    rows = [{"id": "mine/0", "text": "def f(x):\n    return x + 1\n" * 3},
            {"id": "mine/1", "text": "for i in range(10):\n    print(i)\n" * 3}]
    (data / "ppl_segments.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = pytester.path / "r.json"
    pytester.runpytest("--pyargs", "dflash_suites", "-m", "ppl", "--dflash-profile", "quick",
                       "--dflash-data", str(data), "--dflash-report", str(report),
                       "-p", "no:cacheprovider")
    tests = json.loads(report.read_text())["routes"]["prefill.geometry.fp16_q7920"]["gates"][
        "ppl"]["tests"]
    segments = next(t for t in tests if "heldout_segments" in t["nodeid"])
    measured = segments["measurements"]
    assert segments["outcome"] == "passed", segments["message"]
    # the long-context test needs long_contexts.jsonl there too: an error naming it, not the
    # shipped contexts in its place
    long = next(t for t in tests if "long_contexts" in t["nodeid"])
    assert long["outcome"] in ("failed", "error") and "long_contexts.jsonl" in long["message"]
    assert measured["data"] == str(data) and measured["segments"] == 2
    assert measured["worst_segment"] in {"mine/0", "mine/1"}
    assert measured["bytes"] == sum(len(r["text"]) for r in rows)
    # the predeclared relative tolerance, as the policy states it
    assert "per byte" in measured["figure"]
    assert f"tolerance {Policy().ppl_rel_tolerance:g}" in measured["figure"]


def test_missing_capabilities_are_named_with_their_reason() -> None:
    class NoVerify:
        capabilities = Capabilities(verify_logits=False, reasons={"verify_logits": "no step"})

    class Plain:  # an engine of the original protocol offers everything
        pass

    assert missing([Plain(), NoVerify()], ["route_hits"]) is None
    reason = missing([Plain(), NoVerify()], ["verify_logits", "route_hits"])
    assert reason is not None and "verify_logits (no step)" in reason
    with pytest.raises(ValueError, match="unknown capabilities"):
        Capabilities(reasons={"logits": "x"})
