"""The shipped model-level gates driven through a real OpenAI-compatible server.

``pytest-dflash serve`` runs as a real process on a free loopback port, started by the plugin
itself from ``--dflash-serve`` once per route selection. The ppl and quality gates must reach
the same verdicts over HTTP as in process, with the same perplexities; a degraded route served
over HTTP must be rejected by the gate; gates needing what a server cannot offer stay pending
with the reason; no server outlives the session.
"""

from __future__ import annotations

import json
import sys

import pytest

from pytest_dflash.engines.openai_server import group_members

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
# imported once here: pytester's in-process runs drop modules they import, and datasets
# cannot be imported twice in one process (pyarrow extension types are registered globally)
pytest.importorskip("datasets")

FP16 = "prefill.geometry.fp16_q7920"
SERVE = f"{sys.executable} -m pytest_dflash.cli serve --port {{port}}"
COMMON = ["--pyargs", "dflash_suites", "--dflash-profile", "quick", "-p", "no:cacheprovider"]

DEGRADED = '''
import torch

from pytest_dflash import Route
from pytest_dflash.engines.geometry import Geometry

# A planted defect: the SSM state is stored as int8 between chunks (values truncated).
INT8_STATE = Geometry("prefill.geometry.int8_state", torch.int8, 3296)


def pytest_dflash_routes(registry):
    registry.register(Route("prefill.geometry.int8_state", "prefill.geometry", "candidate",
                            baseline="prefill.geometry.fp32_q3296", gates=("ppl",),
                            impl="degraded_routes:INT8_STATE"))
'''


def small_project(pytester: pytest.Pytester, tasks: int = 2) -> list[str]:
    """Keep the test's runtime small: two held-out segments and ``tasks`` coding tasks through
    ``--dflash-data``, completions capped at 64 tokens by the project's own policy."""
    from pytest_dflash.engines.data import LONG_FILE, PPL_FILE, TASKS_FILE, data_dir

    shipped = data_dir()
    data = pytester.mkdir("data")
    for name, rows in ((PPL_FILE, 2), (LONG_FILE, 1), (TASKS_FILE, tasks)):
        lines = (shipped / name).read_text().splitlines()[:rows]
        (data / name).write_text("\n".join(lines) + "\n")
    pytester.makepyprojecttoml("[tool.pytest-dflash]\nquality_max_new_tokens = 64\n")
    return ["--dflash-data", str(data)]


def servers_of(report: dict) -> list[dict]:
    """Every server the session started, from the engines' route proof in the report."""
    found = []
    for entry in report["routes"].values():
        for gate in entry["gates"].values():
            for test in gate["tests"]:
                found += test["measurements"].get("servers", [])
    return found


def gate_tests(report: dict, route: str, kind: str) -> list[dict]:
    return report["routes"][route]["gates"][kind]["tests"]


def test_ppl_and_quality_over_http_match_in_process(pytester: pytest.Pytester) -> None:
    args = [*COMMON, *small_project(pytester), "-m", "ppl or quality", "--dflash-route", FP16]
    local_path, served_path = pytester.path / "local.json", pytester.path / "served.json"
    local_run = pytester.runpytest(*args, "--dflash-report", str(local_path))
    served_run = pytester.runpytest(*args, "--dflash-report", str(served_path),
                                    "--dflash-serve", SERVE)
    local, served = json.loads(local_path.read_text()), json.loads(served_path.read_text())
    for kind in ("ppl", "quality"):
        outcomes = [t["outcome"] for t in gate_tests(served, FP16, kind)]
        # two tasks give the quality gate no power: inconclusive on both sides, never an error
        decided = ("passed", "failed") if kind == "ppl" else ("inconclusive",)
        assert outcomes and all(o in decided for o in outcomes), (kind, outcomes)
        assert served["routes"][FP16]["gates"][kind]["status"] == \
            local["routes"][FP16]["gates"][kind]["status"]
    assert served["routes"][FP16]["verdict"] == local["routes"][FP16]["verdict"]
    assert served_run.ret == local_run.ret

    ppl_local, ppl_served = (
        next(t for t in gate_tests(report, FP16, "ppl") if "heldout_segments" in t["nodeid"])[
            "measurements"] for report in (local, served))
    for key in ("per_segment_baseline", "per_segment_candidate"):
        assert len(ppl_served[key]) == len(ppl_local[key]) >= 2
        for got, want in zip(ppl_served[key], ppl_local[key], strict=True):
            assert abs(got - want) <= 1e-6 * want, (key, got, want)
    q_local = gate_tests(local, FP16, "quality")[0]["measurements"]["per_task"]
    q_served = gate_tests(served, FP16, "quality")[0]["measurements"]["per_task"]
    assert [(t["task_id"], t["baseline"]["passed"], t["candidate"]["passed"]) for t in q_served] \
        == [(t["task_id"], t["baseline"]["passed"], t["candidate"]["passed"]) for t in q_local]
    assert all("completion" in t["candidate"] and "status" in t["candidate"] for t in q_served)

    servers = servers_of(served)
    assert {tuple(s["enabled_routes"]) for s in servers} == {(), (FP16,)}
    assert all(s["switches"] == ({"DFLASH_PREFILL_GEOMETRY_FP16_Q7920": "1"}
                                 if s["enabled_routes"] else {}) for s in servers)
    assert all(not group_members(s["pid"]) for s in servers), "a server outlived the session"


def test_a_degraded_route_served_over_http_is_rejected_by_the_ppl_gate(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(degraded_routes=DEGRADED)
    pytester.syspathinsert()
    report = pytester.path / "degraded.json"
    result = pytester.runpytest(
        "-p", "degraded_routes", *COMMON, "-m", "ppl",
        "--dflash-route", "prefill.geometry.int8_state", "--dflash-report", str(report),
        "--dflash-serve", f"{SERVE} --plugin degraded_routes",
        "--dflash-every-test")  # both ppl tests must reject it, not only the first
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["prefill.geometry.int8_state*FAIL*REJECT*"])
    tests = gate_tests(json.loads(report.read_text()), "prefill.geometry.int8_state", "ppl")
    # the held-out segments and the long contexts: each rejects it, neither errors
    assert [t["outcome"] for t in tests] == ["failed", "failed"], \
        "rejected by the gate, not by an error"
    assert "> tolerance" in tests[0]["message"]
    servers = tests[0]["measurements"]["servers"]
    assert any(s["enabled_routes"] == ["prefill.geometry.int8_state"] for s in servers)
    assert all(not group_members(s["pid"]) for s in servers)


def test_gates_a_server_cannot_serve_stay_pending_with_the_reason(
        pytester: pytest.Pytester) -> None:
    report = pytester.path / "pending.json"
    result = pytester.runpytest(
        *COMMON, "--dflash-gate", f"{FP16}:prefill", "--dflash-report", str(report),
        "--dflash-serve", SERVE, "-rs")
    assert result.ret == pytest.ExitCode.OK
    entry = json.loads(report.read_text())["routes"][FP16]
    assert entry["gates"]["prefill"]["status"] == "pending"
    assert all(t["outcome"] == "skipped" and "first_token_hash" in t["message"]
               for t in entry["gates"]["prefill"]["tests"])
    result.stdout.fnmatch_lines(["*prefill pending*first_token_hash*"])


# A server route: the pytest side knows only its name and that it is switched on the server
# (impl None, as llama.cpp's routes); the geometry object lives in the server's own plugin.
SERVER_SIDE = '''
import torch

from pytest_dflash import Route
from pytest_dflash.engines.geometry import Geometry

FP16_STATE = Geometry("prefill.geometry.srv_fp16", torch.float16, 7920)
INT8_STATE = Geometry("prefill.geometry.srv_int8", torch.int8, 3296)


def pytest_dflash_routes(registry):
    for name in ("FP16_STATE", "INT8_STATE"):
        route = globals()[name]
        registry.register(Route(route.name, "prefill.geometry", "candidate",
                                baseline="prefill.geometry.fp32_q3296", gates=("ppl",),
                                impl=f"server_side:{name}"))
'''

CLIENT_SIDE = '''
from pytest_dflash import Route


def pytest_dflash_routes(registry):
    for name in ("prefill.geometry.srv_fp16", "prefill.geometry.srv_int8"):
        registry.register(Route(name, "prefill.geometry", "candidate",
                                baseline="prefill.geometry.fp32_q3296", gates=("ppl",)))
'''


def test_a_server_route_without_a_geometry_object_is_decided_by_figures(
        pytester: pytest.Pytester) -> None:
    """Every model-level gate scores a route it has no object for (impl None): the long
    contexts are cut into position bands instead of seams, and nothing raises."""
    pytester.makepyfile(server_side=SERVER_SIDE, client_side=CLIENT_SIDE)
    pytester.syspathinsert()
    report_path = pytester.path / "server-routes.json"
    result = pytester.runpytest(
        "-p", "client_side", *COMMON, *small_project(pytester), "-m", "ppl",
        "--dflash-route", "prefill.geometry.srv_fp16",
        "--dflash-route", "prefill.geometry.srv_int8", "--dflash-report", str(report_path),
        "--dflash-serve", f"{SERVE} --plugin server_side",
        "--dflash-every-test")  # both ppl tests score each route
    report = json.loads(report_path.read_text())
    for route in ("prefill.geometry.srv_fp16", "prefill.geometry.srv_int8"):
        tests = gate_tests(report, route, "ppl")
        assert [t["outcome"] for t in tests if "raised" in t] == [], tests
        assert len(tests) == 2 and all(t["outcome"] in ("passed", "failed") for t in tests)
        long = next(t for t in tests if "long_contexts" in t["nodeid"])["measurements"]
        assert long["chunk_tokens"]["candidate"] is None
        assert "chunk not declared" in long["figure"]
        assert len(next(iter(long["bands"].values()))) == 5  # four position bands, the tail
    assert report["routes"]["prefill.geometry.srv_int8"]["verdict"] == "reject"
    assert report["routes"]["prefill.geometry.srv_fp16"]["verdict"] == "accept"
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    servers = servers_of(report)
    assert {tuple(s["enabled_routes"]) for s in servers} >= {
        ("prefill.geometry.srv_int8",), ("prefill.geometry.srv_fp16",)}
    assert all(not group_members(s["pid"]) for s in servers)
