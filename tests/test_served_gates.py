"""The shipped model-level gates driven through a real OpenAI-compatible server.

``pytest-dflash serve`` runs as a real process on a free loopback port, started by the plugin
itself from ``--dflash-serve`` once per route selection. A degraded route served over HTTP must
be rejected by the gate; gates needing what a server cannot offer stay pending with the reason;
no server outlives the session.
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


def gate_tests(report: dict, route: str, kind: str) -> list[dict]:
    return report["routes"][route]["gates"][kind]["tests"]


def test_a_degraded_route_served_over_http_is_rejected_by_the_ppl_gate(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(degraded_routes=DEGRADED)
    pytester.syspathinsert()
    report = pytester.path / "degraded.json"
    result = pytester.runpytest(
        "-p", "degraded_routes", *COMMON, "-m", "ppl",
        "--dflash-route", "prefill.geometry.int8_state", "--dflash-report", str(report),
        "--dflash-serve", f"{SERVE} --plugin degraded_routes")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["prefill.geometry.int8_state*FAIL*REJECT*"])
    tests = gate_tests(json.loads(report.read_text()), "prefill.geometry.int8_state", "ppl")
    assert [t["outcome"] for t in tests] == ["failed"], "rejected by the gate, not by an error"
    assert "> tolerance" in tests[0]["message"]
    servers = tests[0]["measurements"]["servers"]
    assert any(s["enabled_routes"] == ["prefill.geometry.int8_state"] for s in servers)
    assert all(not group_members(s["pid"]) for s in servers)


def test_gates_a_server_cannot_serve_stay_pending_with_the_reason(
        pytester: pytest.Pytester) -> None:
    report = pytester.path / "pending.json"
    result = pytester.runpytest(
        *COMMON, "--dflash-gate", f"{FP16}:speed", "--dflash-report", str(report),
        "--dflash-serve", SERVE, "-rs")
    assert result.ret == pytest.ExitCode.OK
    entry = json.loads(report.read_text())["routes"][FP16]
    assert entry["gates"]["speed"]["status"] == "pending"
    assert all(t["outcome"] == "skipped" and "first_token_hash" in t["message"]
               for t in entry["gates"]["speed"]["tests"])
    result.stdout.fnmatch_lines(["*speed pending*first_token_hash*"])
