"""A route registered by another project is gated by the shipped suites exactly like ours.

The outside project is a plugin module (``-p mine_routes``) registering two attn.d256
candidates written in plain torch: a correct one, accepted on parity, and one whose softmax
scale is 1% off, which the same shipped parity suite must reject.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# the outside project's plugin module: the shared plain-torch attention, then its routes
ROUTES = Path(__file__).with_name("outside_attention.py").read_text() + '''
from pytest_dflash import Route
def pytest_dflash_routes(registry):
    registry.register(Route("attn.d256.mine", "attn.d256", "candidate",
                            baseline="attn.d256.sdpa", gates=("parity",),
                            impl=Attention("attn.d256.mine")))
    registry.register(Route("attn.d256.wrongscale", "attn.d256", "candidate",
                            baseline="attn.d256.sdpa", gates=("parity",),
                            impl=Attention("attn.d256.wrongscale", scale_error=1.01)))
'''


def test_outside_routes_are_gated_by_the_shipped_parity_suite(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(mine_routes=ROUTES)
    pytester.syspathinsert()
    report = pytester.path / "outside-report.json"
    result = pytester.runpytest(
        "-p", "mine_routes", "--pyargs", "dflash_suites", "-m", "parity",
        "--dflash-route", "attn.d256.mine", "--dflash-route", "attn.d256.wrongscale",
        "--dflash-profile", "quick", "--dflash-report", str(report), "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["attn.d256.mine*pass*ACCEPT*",
                                 "attn.d256.wrongscale*FAIL*REJECT*"])
    routes = json.loads(report.read_text())["routes"]
    assert set(routes) == {"attn.d256.mine", "attn.d256.wrongscale"}
    mine = routes["attn.d256.mine"]["gates"]["parity"]["tests"]
    wrong = routes["attn.d256.wrongscale"]["gates"]["parity"]["tests"]
    assert len(mine) == len(wrong) >= 4, "both routes must face the same parity tests"
    assert all(t["outcome"] == "passed" for t in mine)
    assert any(t["outcome"] == "failed" and "parity cases failed" in t["message"] for t in wrong)
