"""Shards of real gates, run as separate processes in separate folders (as on three hosts), then
joined by ``pytest-dflash merge``: the merged evidence decides as one run does, and every merge
that would mix experiments is refused, naming why."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

from pytest_dflash.evidence import report as reports

ROUTE = "attn.d256.fa2"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_dflash.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def _outcomes(data: dict, kind: str) -> dict[str, str]:
    return {t["nodeid"]: t["outcome"] for t in data["routes"][ROUTE]["gates"][kind]["tests"]}


def _edited(source: Path, target: Path, edit) -> Path:
    """A copy of a real report with one change, written as the plugin writes reports (its
    derived fields recomputed), so only the change is under test."""
    data = json.loads(source.read_text())
    edit(data)
    reports.write_atomic(data, target)
    return target


def test_merged_shards_decide_as_one_run(real_runs) -> None:
    merged, one = real_runs.load(real_runs.merged), real_runs.load(real_runs.unsharded)
    for kind in ("loader", "parity"):
        assert _outcomes(merged, kind) == _outcomes(one, kind), kind
        for field in ("status", "figure"):  # the figure too: tests back in one run's order
            assert merged["routes"][ROUTE]["gates"][kind][field] == \
                one["routes"][ROUTE]["gates"][kind][field]
    assert _outcomes(one, "parity") and _outcomes(one, "loader")
    speed = merged["routes"][ROUTE]["gates"]["speed"]
    assert speed["status"] in ("passed", "failed"), speed  # every timing gate decided
    shards = [real_runs.load(p) for p in real_runs.shards]
    owners = [s["shard"]["index"] for s in shards if s["routes"][ROUTE]["gates"]["speed"]["tests"]]
    assert len(owners) == 1  # the timing gate ran whole in one shard
    assert {t["shard"] for g in merged["routes"][ROUTE]["gates"].values()
            for t in g["tests"]} <= {1, 2, 3}
    assert merged["shards"]["missing"] == [] and len(merged["shards"]["merged"]) == 3
    # the verdict of the merged report is computed like any other's
    verdict = _cli("verdict", real_runs.merged)
    assert verdict.returncode == (0 if merged["routes"][ROUTE]["verdict"] == "accept" else 1)
    assert ROUTE in verdict.stdout and "speed: ratio" in verdict.stdout


def test_a_shard_that_never_arrived_leaves_its_routes_pending_and_is_named(real_runs,
                                                                           tmp_path) -> None:
    shards = [real_runs.load(p) for p in real_runs.shards]
    absent = next(s["shard"]["index"] for s in shards if any(
        t for g in s["routes"][ROUTE]["gates"].values() for t in g["tests"]))
    given = [p for p, s in zip(real_runs.shards, shards, strict=True)
             if s["shard"]["index"] != absent]
    out = tmp_path / "partial.json"
    done = _cli("merge", out, *given)
    assert done.returncode == 0, done.stderr
    assert f"missing shards: {absent}/3" in done.stdout
    data = reports.load(out)
    assert data["routes"][ROUTE]["verdict"] == "pending"
    assert any(f"shard {absent}/3 never arrived" in reason
               for reason in data["routes"][ROUTE]["reasons"])
    verdict = _cli("verdict", out)
    assert verdict.returncode == 1 and f"shard {absent}/3 never arrived" in verdict.stdout


def test_a_shard_of_other_code_is_refused_naming_the_field(real_runs, tmp_path) -> None:
    s1, s2, s3 = real_runs.shards

    def other_kernels(data: dict) -> None:
        data["fingerprint"]["kernel_sources_sha256"] = "0" * 64

    other = _edited(s2, tmp_path / "s2-other.json", other_kernels)
    done = _cli("merge", tmp_path / "out.json", s1, other, s3)
    assert done.returncode == 2
    assert "kernel sources (field fingerprint.kernel_sources_sha256)" in done.stderr
    assert str(other) in done.stderr and not (tmp_path / "out.json").exists()

    def other_torch(data: dict) -> None:
        data["fingerprint"]["torch"] = "2.12.0+cpu"

    done = _cli("merge", tmp_path / "out.json", s1, s2,
                _edited(s3, tmp_path / "s3-torch.json", other_torch))
    assert done.returncode == 2 and "fingerprint.torch" in done.stderr

    libraries = [lib for p in (s1, s2) for lib in real_runs.load(p)["fingerprint"]["libraries"]]
    assert libraries, "neither shard recorded a loaded native library"

    def other_library(data: dict) -> None:  # the same library, built from other bytes
        data["fingerprint"]["libraries"] = [{**libraries[0], "sha256": "1" * 64}]

    done = _cli("merge", tmp_path / "out.json", s1, s2,
                _edited(s3, tmp_path / "s3-lib.json", other_library))
    assert done.returncode == 2 and "fingerprint.libraries" in done.stderr
    assert Path(libraries[0]["path"]).name in done.stderr

    def looser(data: dict) -> None:
        data["policy"]["speed_min_gain"] = 0.005

    done = _cli("merge", tmp_path / "out.json", s1, s2, _edited(s3, tmp_path / "p.json", looser))
    assert done.returncode == 2 and "field policy.speed_min_gain" in done.stderr


def _split_gate(real_runs) -> tuple[Path, Path, Path]:
    """Two shards that both hold tests of one gate (parity is split test by test), and the
    third."""
    shards = [real_runs.load(p) for p in real_runs.shards]
    holders = [p for p, s in zip(real_runs.shards, shards, strict=True)
               if s["routes"][ROUTE]["gates"]["parity"]["tests"]]
    assert len(holders) >= 2, "the parity gate's tests were not split over two shards"
    rest = next(p for p in real_runs.shards if p not in holders[:2])
    return holders[0], holders[1], rest


def test_one_gate_from_two_device_models_is_refused_one_model_on_two_hosts_is_not(
        real_runs, tmp_path) -> None:
    first, second, rest = _split_gate(real_runs)

    def other_model(data: dict) -> None:
        data["device"]["name"] = "cpu (64 cores, 64 threads)"
        data["fingerprint"]["device"] = data["device"]["name"]

    done = _cli("merge", tmp_path / "out.json", first,
                _edited(second, tmp_path / "model.json", other_model), rest)
    assert done.returncode == 2
    held = {p: {k for k, g in real_runs.load(p)["routes"][ROUTE]["gates"].items()
                if g["tests"]} for p in (first, second, rest)}
    shared = held[second] & (held[first] | held[rest])
    assert any(f"the {kind} gate of {ROUTE} was measured on different device models"
               in done.stderr for kind in shared), done.stderr
    assert "cpu (64 cores, 64 threads)" in done.stderr

    def other_host(data: dict) -> None:
        data["shard"]["host"] = "another-host"

    done = _cli("merge", tmp_path / "out.json", first,
                _edited(second, tmp_path / "host.json", other_host), rest)
    assert done.returncode == 0, done.stderr
    hosts = {m["host"] for m in reports.load(tmp_path / "out.json")["shards"]["merged"]}
    assert "another-host" in hosts and len(hosts) == 2


def test_one_test_with_two_outcomes_is_refused_naming_both_files(real_runs, tmp_path) -> None:
    first, second, rest = _split_gate(real_runs)
    test = copy.deepcopy(real_runs.load(first)["routes"][ROUTE]["gates"]["parity"]["tests"][0])

    def rerun_failed(data: dict) -> None:
        data["routes"][ROUTE]["gates"]["parity"]["tests"].append(
            {**test, "outcome": "failed", "message": "a rerun that failed"})

    clash = _edited(second, tmp_path / "clash.json", rerun_failed)
    done = _cli("merge", tmp_path / "out.json", first, clash, rest)
    assert done.returncode == 2
    assert f"test {test['nodeid']} is passed in {first} and failed in {clash}" in done.stderr


def test_a_tampered_or_malformed_shard_is_exit_2_as_for_verdict(real_runs, tmp_path) -> None:
    s1, s2, s3 = real_runs.shards
    data = json.loads(s2.read_text())
    data["routes"][ROUTE]["verdict"] = "accept" if data["routes"][ROUTE]["verdict"] != \
        "accept" else "reject"
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(data))
    done = _cli("merge", tmp_path / "out.json", s1, tampered, s3)
    assert done.returncode == 2 and "corrupt report" in done.stderr
    assert _cli("verdict", tampered).stderr.split(": ", 1)[1] in done.stderr
    truncated = tmp_path / "truncated.json"
    truncated.write_text(s3.read_text()[:500])
    done = _cli("merge", tmp_path / "out.json", s1, s2, truncated)
    assert done.returncode == 2 and "not valid JSON" in done.stderr
    assert not (tmp_path / "out.json").exists()


def test_shards_of_another_plan_are_refused(real_runs, tmp_path) -> None:
    s1, s2, s3 = real_runs.shards

    def other_plan(data: dict) -> None:
        data["shard"]["plan_sha256"] = "f" * 64

    done = _cli("merge", tmp_path / "out.json", s1, s2,
                _edited(s3, tmp_path / "plan.json", other_plan))
    assert done.returncode == 2 and "shard.plan_sha256" in done.stderr


def test_the_junit_of_the_shard_that_timed_the_speed_gate_carries_its_interval(
        real_runs) -> None:
    import xml.etree.ElementTree as ET

    found = []
    for report, xml in zip(real_runs.shards, real_runs.junit, strict=True):
        for case in ET.parse(xml).iter("testcase"):
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            if props.get("dflash_route") == ROUTE and props.get("dflash_kind") == "speed":
                found.append((report, props))
    assert len(found) == 1  # the gate ran whole in one shard
    report, props = found[0]
    measured = real_runs.load(report)["routes"][ROUTE]["gates"]["speed"]["tests"][0][
        "measurements"]
    assert float(props["dflash_ci_low"]) == float(f"{measured['ci_low']:.6g}")
    assert float(props["dflash_ci_high"]) == float(f"{measured['ci_high']:.6g}")
    assert props["dflash_ci_units"] == str(len(measured["processes"]))
    assert props["dflash_decision"] == measured["decision"]


def test_the_markdown_summary_of_a_merge_names_its_shards(real_runs) -> None:
    done = _cli("verdict", real_runs.merged, "--format", "markdown")
    assert done.returncode in (0, 1), done.stderr
    assert "Evidence merged from 3 reports (1/3, 2/3, 3/3) on 1 host" in done.stdout
    assert f"| `{ROUTE}` |" in done.stdout and "speed" in done.stdout
