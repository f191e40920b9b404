"""Timing gates through the real plugin (pytester): a gate timed in the run's worker processes,
and an inconclusive gate that leaves its route pending (table, report, JUnit, strict)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

CONFTEST = """
from pytest_dflash import Family, Route

def pytest_dflash_routes(registry):
    registry.declare(Family("toy.spin", None, baseline="toy.spin.base", gates=("speed",)))
    registry.register(Route("toy.spin.base", "toy.spin", "baseline", impl="toyjobs:BASE"))
    registry.register(Route("toy.spin.slow", "toy.spin", "candidate", baseline="toy.spin.base",
                            gates=("speed",), impl="toyjobs:SLOW"))
    registry.register(Route("toy.spin.same", "toy.spin", "candidate", baseline="toy.spin.base",
                            gates=("speed",), impl="toyjobs:SAME"))
"""

TOYJOBS = """
import time

from pytest_dflash.native import hits
from pytest_dflash.measure.timing_pool import TimedPair


class Spin:
    def __init__(self, name, seconds):
        self.name, self.seconds = name, seconds

    def __call__(self):
        hits.record(self.name, "spin")
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass


BASE = Spin("toy.spin.base", 0.0004)
SLOW = Spin("toy.spin.slow", 0.0008)
SAME = Spin("toy.spin.same", 0.0004)


def pair(ctx, *, route):
    impl = ctx.implementation(route)
    base = ctx.implementation(ctx.registry.get(route).baseline)
    return TimedPair(impl, base)
"""

GATES = """
import pytest

from pytest_dflash.native import hits
from pytest_dflash.measure.timing_pool import TimingJob
from pytest_dflash.measure.timing import TimingInconclusive, speed_gate

pytestmark = pytest.mark.sm70


@pytest.mark.gate("speed", family="toy.spin")
def test_speed(dflash_gate):
    job = TimingJob("toyjobs:pair", {"route": dflash_gate.route.name})
    try:
        with hits.counting() as delta:
            speed_gate(None, None, policy=dflash_gate.policy, device=dflash_gate.device,
                       record=dflash_gate.record, label="spin", job=job,
                       timing=dflash_gate.timing)
    finally:  # the delta is filled once the block has exited
        dflash_gate.record(route_hits=delta.as_json())
"""

UNDECIDED = """
import pytest

from pytest_dflash.measure.timing import TimingInconclusive

pytestmark = pytest.mark.sm70


@pytest.mark.gate("speed", family="toy.spin")
def test_speed(dflash_gate):
    dflash_gate.record(figure="ratio 0.992 [0.981, 1.003] over 18 processes x 24 rounds",
                       decision="inconclusive", rule="gain", threshold=0.99, ci_low=0.981,
                       ci_high=1.003)
    raise TimingInconclusive("spin: inconclusive, route left pending: ratio 0.992 [0.981, "
                             "1.003] straddles the margin")
"""

PYPROJECT = """
[tool.pytest-dflash]
timing_processes = 3
timing_max_processes = 3
timing_min_rounds_per_process = 8
timing_process_s = 0.0
cpu_validation_process_s = 0.0
"""

ROUTE = ["--dflash-route", "toy.spin.slow", "--dflash-device", "cpu", "-p", "no:cacheprovider"]


@pytest.fixture
def toy(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(toyjobs=TOYJOBS)
    pytester.makefile(".toml", pyproject=PYPROJECT)
    pytester.syspathinsert()
    return pytester


def _report(pytester: pytest.Pytester) -> dict:
    return json.loads((pytester.path / "dflash-report.json").read_text())


@pytest.mark.idle_cores  # the planted 2x must be decided on 3 processes
def test_a_gate_timed_in_worker_processes_decides_across_them(toy: pytest.Pytester) -> None:
    toy.makepyfile(test_gates=GATES)
    result = toy.runpytest_subprocess("-m", "sm70", *ROUTE)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*spin: slower, rejected on speed: ratio * over 3 processes x 8 rounds*"]
    )
    test = _report(toy)["routes"]["toy.spin.slow"]["gates"]["speed"]["tests"][0]
    measured = test["measurements"]
    assert (test["outcome"], measured["decision"], measured["unit"]) == (
        "failed",
        "fail",
        "process",
    )
    pids = {p["pid"] for p in measured["processes"]}
    assert len(pids) == 3 and all(len(p["orders"]) == 8 for p in measured["processes"])
    assert 1.5 < measured["ratio_median"] < 4.0  # the planted 2x; preemption stretches spins
    # the workers' route hits came back to the gate: 8 timed rounds of each process, per side
    calls = sum(8 * p["info"]["calls_per_sample"] for p in measured["processes"])
    assert measured["route_hits"] == {"toy.spin.base/spin": calls, "toy.spin.slow/spin": calls}


def test_inconclusive_leaves_the_route_pending_and_strict_fails(toy: pytest.Pytester) -> None:
    toy.makepyfile(test_gates=UNDECIDED)
    junit = toy.path / "junit.xml"
    result = toy.runpytest("-m", "sm70", f"--junitxml={junit}", *ROUTE)
    assert result.ret == pytest.ExitCode.OK  # pending is not a failure without --dflash-strict
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            "toy.spin.slow*inconcl*PENDING*",
            "*speed pending: inconclusive timing (spin: inconclusive*",
        ]
    )
    entry = _report(toy)["routes"]["toy.spin.slow"]
    assert entry["verdict"] == "pending"
    assert entry["gates"]["speed"]["tests"][0]["outcome"] == "inconclusive"
    assert "slower" not in " ".join(entry["reasons"])
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).iter("property")}
    assert props["dflash_decision"] == "inconclusive"
    assert props["dflash_verdict.toy.spin.slow"] == "pending"
    strict = toy.runpytest("-m", "sm70", "--dflash-strict", *ROUTE)
    assert strict.ret == pytest.ExitCode.TESTS_FAILED
    strict.stdout.fnmatch_lines(["*strict mode: selected candidates left pending: toy.spin.slow*"])


SPLIT_CONFTEST = CONFTEST + """
    registry.register(Route("toy.spin.split", "toy.spin", "candidate", baseline="toy.spin.base",
                            gates=("speed",), impl="toyjobs:SAME"))
"""

SPLIT_JOBS = TOYJOBS + """
import fcntl
import os


def split_pair(ctx, *, route):
    # every other timing process times a candidate 10% faster, the others one 10% slower: the
    # interval of two (or four) processes straddles the margin whatever the cores' noise
    with open(os.path.join(os.path.dirname(__file__), "split.count"), "a+") as count:
        fcntl.flock(count, fcntl.LOCK_EX)
        count.seek(0)
        built = len(count.read())
        count.write("x")
    return TimedPair(Spin(route, 0.00036 if built % 2 else 0.00044), BASE)
"""


def test_the_quick_and_ci_profiles_time_one_look(toy: pytest.Pytester) -> None:
    """``quick`` and ``ci`` (``ProfileSizes.timing_looks``) take one look of the policy's
    processes, where ``full`` goes on looking at a gate that has not decided (a candidate 10%
    faster in every other process and 10% slower in the rest: no number of processes decides
    the 1% gain, and with the futility stop off the full run looks again). The implicit
    profile of a CPU run is ci and is sized too, though it is known only once the device is.
    The cap is in the report's policy and the workers'."""
    toy.makeconftest(SPLIT_CONFTEST)
    toy.makepyfile(toyjobs=SPLIT_JOBS,
                   test_gates=GATES.replace('"toyjobs:pair"', '"toyjobs:split_pair"'))
    toy.makefile(".toml", pyproject="[tool.pytest-dflash]\ntiming_processes = 2\n"
                 "timing_max_processes = 4\ntiming_min_rounds_per_process = 8\n"
                 "timing_process_s = 0.0\ntiming_futility = 0\n")
    split = ["--dflash-route", "toy.spin.split", "--dflash-device", "cpu",
             "-p", "no:cacheprovider"]
    looks = {}
    for profile in ("quick", "ci", "full", None):
        asked = ["--dflash-profile", profile] if profile else []
        toy.runpytest("-m", "sm70", *asked, *split)
        report = _report(toy)
        assert report["profile"] == (profile or "ci")
        test = report["routes"]["toy.spin.split"]["gates"]["speed"]["tests"][0]
        assert test["outcome"] == "inconclusive", test["message"]
        looks[profile] = test["measurements"]["looks"]
        assert report["policy"]["timing_max_processes"] == (4 if profile == "full" else 2)
    assert looks == {"quick": [2], "ci": [2], "full": [2, 4], None: [2]}, looks


SHARED_JOBS = """

from pytest_dflash.measure.timing_pool import TimedArms


def arms(ctx, *, routes, baseline):
    return TimedArms(ctx.implementation(baseline),
                     {route: ctx.implementation(route) for route in routes})


def broken_arms(ctx, *, routes, baseline):
    raise RuntimeError("the group's builder broke")
"""

SHARED = """
import os

import pytest

from pytest_dflash.measure.timing import SharedLook, speed_gate
from pytest_dflash.measure.timing_pool import TimingJob

pytestmark = pytest.mark.sm70


@pytest.mark.gate("speed", family="toy.spin")
def test_speed(dflash_gate):
    route = dflash_gate.route
    peers = [peer.name for peer in dflash_gate.peers()]
    dflash_gate.record(peers=peers)
    group = TimingJob(os.environ["TOY_ARMS"], {"routes": [route.name, *peers],
                                               "baseline": route.baseline}) if peers else None
    speed_gate(None, None, policy=dflash_gate.policy, device=dflash_gate.device,
               record=dflash_gate.record, label="spin",
               job=TimingJob("toyjobs:pair", {"route": route.name}), timing=dflash_gate.timing,
               shared=SharedLook("toy spin", route.name, dflash_gate.timing.looks, group))
"""


def test_gates_of_one_baseline_share_their_first_look(toy: pytest.Pytester,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two routes of one baseline: the first gate times the first look of both in the same
    rounds (the baseline once a round), the second takes its samples from the session. Each
    route's ratio is still its own (the planted 2x, identical code at 1), paired with the
    baseline runs of its own rounds. A look of the full profile after the first is each
    route's own; a group whose look fails is said in the record and each route is timed
    alone. It runs beside the other xdist worker: a planted 2x is decided through any noise
    of a shared core, and identical code against no gain looks again unless its first look,
    at a tenth of the error rate, decides (as in the test above)."""
    toy.makepyfile(test_gates=SHARED)
    with open(toy.path / "toyjobs.py", "a", encoding="utf-8") as fh:
        fh.write(SHARED_JOBS)
    # no gain asked: identical code straddles the margin, so the full profile looks again
    toy.makefile(".toml", pyproject="[tool.pytest-dflash]\ntiming_processes = 3\n"
                 "timing_max_processes = 6\ntiming_min_rounds_per_process = 8\n"
                 "timing_process_s = 0.0\ntiming_futility = 0\nspeed_min_gain = 0.0\n")
    both = ["--dflash-route", "toy.spin.slow", "--dflash-route", "toy.spin.same",
            "--dflash-device", "cpu", "-p", "no:cacheprovider", "--dflash-every-test"]

    def tests() -> dict[str, dict]:
        routes = _report(toy)["routes"]
        return {name: routes[name]["gates"]["speed"]["tests"][0]["measurements"]
                for name in ("toy.spin.slow", "toy.spin.same")}

    monkeypatch.setenv("TOY_ARMS", "toyjobs:arms")
    toy.runpytest_subprocess("-m", "sm70", "--dflash-profile", "full", *both)
    slow, same = tests().values()
    # the first of the two to run timed the look for both
    assert sorted([slow["peers"], same["peers"]]) in ([[], ["toy.spin.same"]],
                                                      [[], ["toy.spin.slow"]])
    for mine, theirs in zip(slow["processes"][:3], same["processes"][:3], strict=True):
        assert mine["pid"] == theirs["pid"]
        assert mine["info"]["arms"] == theirs["info"]["arms"] == ["toy.spin.same",
                                                                  "toy.spin.slow"]
        # one baseline run a round, shared: the same seconds in both routes' samples
        assert mine["samples"]["baseline"] == theirs["samples"]["baseline"]
        assert mine["samples"]["candidate"] != theirs["samples"]["candidate"]
    assert 1.5 < slow["ratio_median"] < 4.0  # the planted 2x
    assert 0.8 < same["ratio_median"] < 1.25  # identical code
    # identical code against a 1% gain looks again (full profile), in its own processes
    assert same["looks"] == [3, 6]
    assert all("arms" not in p["info"] for p in same["processes"][3:])
    assert "shared_look" not in slow and "shared_look" not in same

    monkeypatch.setenv("TOY_ARMS", "toyjobs:broken_arms")
    toy.runpytest_subprocess("-m", "sm70", *both)
    slow, same = tests().values()
    leader, follower = (slow, same) if slow["peers"] else (same, slow)
    assert leader["shared_look"].startswith("not shared, timed alone: the group's look failed")
    assert "the group's builder broke" in leader["shared_look"] and "shared_look" not in follower
    assert slow["decision"] == "fail" and 1.5 < slow["ratio_median"] < 4.0
    assert all("arms" not in p["info"] for p in slow["processes"] + same["processes"])
