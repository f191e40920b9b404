"""One GPU per xdist worker (pytest_dflash.xdist.gpus and its wiring in pytest_dflash.xdist.plugin).

No GPU is needed: the assignment is exercised with the test-only fake device count
(DFLASH_FAKE_GPU_COUNT) through real xdist workers, and the nvidia-smi parsing through a real
subprocess of a stand-in ``nvidia-smi`` on PATH that prints what the driver prints.
"""

from __future__ import annotations

import collections
import json
import os
import stat
from pathlib import Path

import pytest
from toyproject import toy_project

from pytest_dflash.xdist import gpus

H200 = [gpus.Gpu(0, "NVIDIA H200", "GPU-aaaa0000-1111", "9.0"),
        gpus.Gpu(1, "NVIDIA H200", "GPU-bbbb0000-2222", "9.0")]
MIXED = [gpus.Gpu(0, "Tesla V100-SXM2-32GB", "GPU-v100", "7.0"),
         gpus.Gpu(1, "NVIDIA A100-SXM4-40GB", "GPU-a100", "8.0")]


# ---------------------------------------------------------------- discovery


def _fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{exe.parent}:/usr/bin:/bin")


def test_discover_reads_nvidia_smi_and_honours_visible_devices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, monkeypatch,
              'echo "0, NVIDIA H200, GPU-aaaa0000-1111, 9.0"\n'
              'echo "1, NVIDIA H200, GPU-bbbb0000-2222, 9.0"\n')
    assert gpus.discover({"PATH": str(tmp_path / "bin")}) == H200
    assert gpus.discover({"CUDA_VISIBLE_DEVICES": "1"}) == H200[1:]
    assert gpus.discover({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}) == H200[1:]


def test_discover_old_driver_without_compute_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, monkeypatch,
              'case "$1" in *compute_cap*) echo \'Field "compute_cap" is not a valid field to '
              'query.\'; exit 2;; esac\necho "0, Tesla V100-SXM2-32GB, GPU-v100"\n')
    assert gpus.discover({}) == [gpus.Gpu(0, "Tesla V100-SXM2-32GB", "GPU-v100", None)]


def test_discover_no_device_is_empty_but_a_broken_driver_is_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, monkeypatch,
              'if [ -n "$BROKEN" ]; then echo "NVIDIA-SMI has failed because it could not '
              'communicate with the NVIDIA driver."; exit 9; fi\n'
              'echo "No devices were found"; exit 6\n')
    assert gpus.discover({}) == []
    monkeypatch.setenv("BROKEN", "1")
    with pytest.raises(gpus.GpuError, match=r"nvidia-smi failed \(exit 9\).*driver"):
        gpus.discover({})


def test_no_nvidia_smi_means_no_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpus.discover({}) == []


def test_fake_count_is_validated() -> None:
    assert [g.uuid for g in gpus.discover({gpus.FAKE_COUNT_ENV: "2"})] == ["GPU-fake-0",
                                                                           "GPU-fake-1"]
    with pytest.raises(gpus.GpuError, match="whole number"):
        gpus.discover({gpus.FAKE_COUNT_ENV: "two"})


def test_visible_devices_filter_errors_name_the_fix() -> None:
    with pytest.raises(gpus.GpuError, match="entry '5' matches no GPU.*0=GPU-aaaa"):
        gpus.filter_visible(H200, "0,5")
    with pytest.raises(gpus.GpuError, match="by index on a box with several models.*UUIDs"):
        gpus.filter_visible(MIXED, "0")
    assert gpus.filter_visible(MIXED, "1", "PCI_BUS_ID") == MIXED[1:]
    assert gpus.filter_visible(MIXED, "GPU-a100") == MIXED[1:]
    with pytest.raises(gpus.GpuError, match="MIG"):
        gpus.filter_visible(H200, "MIG-aaaa")
    assert gpus.filter_visible(H200, "") == []


def test_parse_smi_rejects_foreign_output() -> None:
    with pytest.raises(gpus.GpuError, match="cannot read nvidia-smi line"):
        gpus.parse_smi("GPU 0: NVIDIA H200 (UUID: GPU-aaaa)\n")


# ---------------------------------------------------------------- plan and worker identity


def test_plan_one_card_per_worker_refuses_too_many_workers_and_mixed_models() -> None:
    assert gpus.plan(H200, 2) == H200
    assert gpus.plan(H200, 1) == H200[:1]
    with pytest.raises(gpus.GpuError, match=r"3 xdist workers but only 2 GPU.*use -n 2"):
        gpus.plan(H200, 3)
    with pytest.raises(gpus.GpuError, match="different models.*one model"):
        gpus.plan(MIXED, 2)
    with pytest.raises(gpus.GpuError, match="nvidia-smi lists no GPU"):
        gpus.plan([], 1)


def test_threads_and_cores_are_shared_out_and_longest_gate_kinds_go_first() -> None:
    assert gpus.worker_spec("popen", 0, H200[0], threads=16).endswith(
        "//env:DFLASH_GPU_SLOT=0//env:OMP_NUM_THREADS=16")
    assert gpus.core_shares(2, cpus=[7, 0, 1, 6, 2, 5, 3, 4]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert gpus.core_shares(3, cpus=range(8)) == [[0, 1], [2, 3], [4, 5]]
    assert gpus.core_shares(3, cpus=[0, 1]) is None
    assert gpus.worker_spec("popen", 1, H200[1], threads=2, cpus=[2, 3]).endswith(
        "//env:OMP_NUM_THREADS=2//env:DFLASH_WORKER_CPUS=2,3")
    kinds = ["parity", None, "ppl", "speed", "quality", "loader", "validation_cost"]
    assert sorted(kinds, key=gpus.schedule_rank) == [
        "validation_cost", "speed", "quality", "loader", "ppl", "parity", None]


def test_worker_identity_round_trip_and_tamper_check() -> None:
    spec = gpus.worker_spec("popen", 1, H200[1])
    assert spec == "popen//env:CUDA_VISIBLE_DEVICES=GPU-bbbb0000-2222//env:DFLASH_GPU_SLOT=1"
    env = {gpus.PLAN_ENV: gpus.encode_plan(H200), gpus.SLOT_ENV: "1",
           "CUDA_VISIBLE_DEVICES": H200[1].uuid}
    assert gpus.worker_gpu(env) == H200[1]
    assert gpus.visible_devices(env) == H200[1].uuid
    assert gpus.worker_gpu({}) is None and gpus.visible_devices({}) is None
    with pytest.raises(gpus.GpuError, match="owns GPU 1.*something changed it"):
        gpus.worker_gpu({**env, "CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(gpus.GpuError, match="not a slot"):
        gpus.worker_gpu({**env, gpus.SLOT_ENV: "7"})
    with pytest.raises(gpus.GpuError, match="local .popen. workers only"):
        gpus.worker_spec("ssh=box//python=python3", 0, H200[0])


def test_a_timing_gate_measured_on_two_card_models_is_taken_back() -> None:
    def test(nodeid: str, gpu: gpus.Gpu | None) -> dict:
        return {"nodeid": nodeid, "outcome": "passed", "message": "",
                "gpu": None if gpu is None else {"index": gpu.index, "name": gpu.name,
                                                 "uuid": gpu.uuid}}

    routes = {"r": {"gates": {
        "speed": {"tests": [test("a", MIXED[0]), test("b", MIXED[1])]},
        "parity": {"tests": [test("c", MIXED[0]), test("d", MIXED[1])]},
        "validation_cost": {"tests": [test("e", H200[0]), test("f", H200[1])]}}}}
    problems = gpus.refuse_mixed_models(routes, ("speed", "validation_cost"))
    assert len(problems) == 1 and "speed gate of r" in problems[0]
    assert "NVIDIA A100-SXM4-40GB, Tesla V100-SXM2-32GB" in problems[0]
    gates = routes["r"]["gates"]
    assert [t["outcome"] for t in gates["speed"]["tests"]] == ["skipped", "skipped"]
    assert [t["outcome"] for t in gates["parity"]["tests"]] == ["passed", "passed"]
    # two cards of one model are fine (a rerun of one test may land on another card)
    assert [t["outcome"] for t in gates["validation_cost"]["tests"]] == ["passed", "passed"]


def test_a_served_engine_started_by_a_gpu_worker_sees_only_its_card(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_dflash.engines.openai_server import server_env
    from pytest_dflash.routes.registry import RouteRegistry
    from pytest_dflash.routes.shipped import SHIPPED_ROUTES

    registry = RouteRegistry()
    for route in SHIPPED_ROUTES:
        registry.register(route)
    base = {"CUDA_VISIBLE_DEVICES": "0,1", "KEEP": "me"}
    assert server_env(registry.engine_selection(), registry, base)["CUDA_VISIBLE_DEVICES"] == "0,1"
    monkeypatch.setenv(gpus.PLAN_ENV, gpus.encode_plan(H200))
    monkeypatch.setenv(gpus.SLOT_ENV, "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", H200[1].uuid)
    env = server_env(registry.engine_selection(), registry, gpus.server_env(base))
    assert env["CUDA_VISIBLE_DEVICES"] == H200[1].uuid and env["KEEP"] == "me"


# ---------------------------------------------------------------- real xdist workers

CONFTEST = """
import os
import subprocess
import sys
import pytest
from pytest_dflash import Family, Route
from pytest_dflash.xdist import gpus
IMPORT_TIME_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")

def pytest_dflash_routes(registry):
    registry.declare(Family("toy.add", None, baseline="toy.add.base", gates=("parity", "speed")))
    registry.register(Route("toy.add.base", "toy.add", "baseline", impl="toyimpl:base"))
    for name in ("toy.add.one", "toy.add.two", "toy.add.three"):
        registry.register(Route(name, "toy.add", "candidate", baseline="toy.add.base",
                                gates=("parity", "speed"), impl="toyimpl:base"))

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before the plugin may refuse a timing gate: which worker, which card, which node id
    # and what a server started by this worker (a served engine) sees, whatever the caller's
    # environment says
    server = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', '-'))"],
        env=gpus.server_env({**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}),
        capture_output=True, text=True, timeout=60).stdout.strip()
    with open(os.environ["TOY_LOG"], "a") as log:
        log.write("\\t".join([item.nodeid, os.environ.get("PYTEST_XDIST_WORKER", "-"),
                              os.environ.get("DFLASH_GPU_SLOT", "-"),
                              os.environ.get("CUDA_VISIBLE_DEVICES", "-"),
                              IMPORT_TIME_VISIBLE or "-", server,
                              os.environ.get("OMP_NUM_THREADS", "-"),
                              ",".join(map(str, sorted(os.sched_getaffinity(0))))]) + "\\n")
"""

TOYIMPL = """
def base(a, b):
    return a + b
"""

GATES = """
import pytest
pytestmark = pytest.mark.sm70

@pytest.mark.gate("parity", family="toy.add")
def test_parity(dflash_route):
    assert dflash_route.implementation()(2, 3) == 5

@pytest.mark.gate("speed", family="toy.add")
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_speed(dflash_route, dflash_record, size):
    dflash_record(figure="ratio 0.50 [0.45, 0.55]", ratio_median=0.5)
"""


@pytest.fixture
def toy(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytest.importorskip("xdist")
    toy_project(pytester, CONFTEST, toyimpl=TOYIMPL, test_gates=GATES)
    monkeypatch.setenv("TOY_LOG", str(pytester.path / "toy.log"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # the caller sets no thread count (under xdist tests/conftest.py shares the cores out)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    return pytester


def _log(pytester: pytest.Pytester) -> list[list[str]]:
    return [line.split("\t") for line in (pytester.path / "toy.log").read_text().splitlines()]


def test_two_fake_gpus_two_workers_each_own_one_and_gates_stay_on_one_card(
        toy: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gpus.FAKE_COUNT_ENV, "2")
    result = toy.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*dflash: 2 xdist workers, one GPU each (worker 0: GPU 0 fake "
                                 "GPU GPU-fake-0; worker 1: GPU 1 fake GPU GPU-fake-1)*"])
    rows = _log(toy)
    assert len(rows) == 3 + 3 * 4
    cards_of_worker = collections.defaultdict(set)
    cores_of_worker = collections.defaultdict(set)
    shares = gpus.core_shares(2)
    for nodeid, worker, slot, visible, at_import, server, threads, cores in rows:
        # each worker runs on its own share of the host's cores, one torch thread per core
        if shares is None:  # fewer cores than workers: nothing to pin
            assert threads == "1", (nodeid, threads)
        else:
            assert cores == ",".join(map(str, shares[int(slot)])), (nodeid, slot, cores)
            assert threads == str(len(shares[int(slot)])), (nodeid, threads)
        cores_of_worker[worker].add(cores)
        # the card was set before the worker imported anything (conftest import time), and a
        # server the worker starts sees that card only
        assert visible == at_import == server == f"GPU-fake-{slot}", (nodeid, worker, visible,
                                                                     at_import, server)
        cards_of_worker[worker].add(visible)
    assert all(len(cards) == 1 for cards in cards_of_worker.values()), cards_of_worker
    owners = [next(iter(c)) for c in cards_of_worker.values()]
    assert len(owners) == len(set(owners)), f"two workers share a card: {cards_of_worker}"
    assert all(len(cores) == 1 for cores in cores_of_worker.values()), cores_of_worker
    # every timing gate (route, speed) is one xdist group: all its tests ran on one worker
    speed = [r for r in rows if "test_speed" in r[0]]
    by_gate = collections.defaultdict(set)
    for nodeid, worker, *_ in speed:
        by_gate[nodeid.split("[")[1].split("-")[0]].add(worker)
    assert set(by_gate) == {"toy.add.one", "toy.add.two", "toy.add.three"}
    assert all(len(workers) == 1 for workers in by_gate.values()), by_gate
    # longest gate kind first: every worker started with a speed test, though the parity
    # tests come first in collection order
    first = {}
    for nodeid, worker, *_ in rows:
        first.setdefault(worker, nodeid)
    assert all("test_speed" in nodeid for nodeid in first.values()), first
    # the merged report names tests exactly as a run without xdist does
    report = json.loads((toy.path / "dflash-report.json").read_text())
    nodeids = [t["nodeid"] for r in report["routes"].values() for g in r["gates"].values()
               for t in g["tests"]]
    assert len(nodeids) == 15 and not any("@" in n for n in nodeids), nodeids
    # torch sees no GPU here: the gates ran on the CPU, so no test claims a card, and the
    # workers refused the timing gates even though each owns a (fake) GPU
    entries = [t for r in report["routes"].values() for g in r["gates"].values()
               for t in g["tests"]]
    assert all("gpu" in t and t["gpu"] is None for t in entries)
    speed = [t for t in entries if "test_speed" in t["nodeid"]]
    assert {t["outcome"] for t in speed} == {"skipped"}
    assert all("owns GPU" in t["message"] and "never share the device" in t["message"]
               for t in speed), speed[0]["message"]


def test_more_workers_than_gpus_is_refused_clearly(
        toy: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gpus.FAKE_COUNT_ENV, "2")
    result = toy.runpytest_subprocess("-n", "3", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*3 xdist workers but only 2 GPU(s) visible*use -n 2 or -n auto*"])
    assert not (toy.path / "toy.log").exists()


def test_auto_means_one_worker_per_gpu(toy: pytest.Pytester,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gpus.FAKE_COUNT_ENV, "3")
    result = toy.runpytest_subprocess("-n", "auto", "-p", "no:cacheprovider", "-k", "parity")
    result.stdout.fnmatch_lines(["*dflash: 3 xdist workers, one GPU each*"])
    assert {row[3] for row in _log(toy)} <= {"GPU-fake-0", "GPU-fake-1", "GPU-fake-2"}


def test_cpu_device_keeps_plain_xdist(toy: pytest.Pytester,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gpus.FAKE_COUNT_ENV, "2")
    result = toy.runpytest_subprocess("-n", "3", "--dflash-device", "cpu", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, skipped=12)  # timing gates refused under xdist on the CPU
    assert "one GPU each" not in result.stdout.str()
    every_core = ",".join(map(str, sorted(os.sched_getaffinity(0))))  # not pinned either
    assert {tuple(row[2:]) for row in _log(toy)} == {("-", "-", "-", "0,1", "-", every_core)}


def test_other_dist_modes_are_refused_in_gpu_mode(toy: pytest.Pytester,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gpus.FAKE_COUNT_ENV, "2")
    result = toy.runpytest_subprocess("-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--dist loadfile could split a timing gate across GPUs*"])


def test_groups_travel_from_workers_to_the_scheduler(tmp_path: Path) -> None:
    gpus.write_groups(str(tmp_path), 0, {"a.py::t[r1-1]": gpus.group_name("r1", "speed")})
    gpus.write_groups(str(tmp_path), 1, {"a.py::t[r2-1]": gpus.group_name("r2", "speed")})
    assert gpus.read_groups(str(tmp_path)) == {"a.py::t[r1-1]": "dflash:r1:speed",
                                               "a.py::t[r2-1]": "dflash:r2:speed"}


def test_a_worker_is_pinned_to_the_cores_its_spec_names_and_bad_values_are_refused() -> None:
    before = os.sched_getaffinity(0)
    one = min(before)
    try:
        assert gpus.pin_worker({gpus.CPUS_ENV: str(one)}) == [one]
        assert os.sched_getaffinity(0) == {one}
    finally:
        os.sched_setaffinity(0, before)
    assert gpus.pin_worker({}) is None
    with pytest.raises(gpus.GpuError, match="not a list of CPU ids; unset it"):
        gpus.pin_worker({gpus.CPUS_ENV: "0,x"})
    with pytest.raises(gpus.GpuError, match="cannot run on those cores"):
        gpus.pin_worker({gpus.CPUS_ENV: "100000"})
    assert os.sched_getaffinity(0) == before
