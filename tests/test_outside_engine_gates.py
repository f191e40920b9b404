"""Outside routes face every model-level gate exactly like shipped ones (the engine is built
from the session's registry), and every gate kind catches the defect planted for it.

The outside project is one plugin module registering, per family and gate kind, a correct
route and one with a planted defect:

| family / gate | correct | planted defect |
|---|---|---|
| attn.d256 parity | plain-torch attention | softmax scale 1% off |
| attn.d256 ppl | plain-torch attention | |
| gemm.nvfp4 parity | (see below) | output 1% off |
| gemm.nvfp4 validation_cost | M <= 8 on the small-M kernel | M <= 8 on the large-M kernel |
| gemm.nvfp4 ppl | M <= 8 on the small-M kernel | output 1% off |
| prefill.geometry ppl | fp32 state, larger chunk | SSM state stored as int8 |
| prefill.geometry quality | fp32 state, larger chunk | SSM state stored as bool |

Timing gates (speed, and the op-level validation-cost timing) are left out: whether a correct
route is *faster* depends on the machine, which a unit test must never assert. The correct gemm
route faces validation_cost only: under gemm parity its quick-profile "tiny weights" fp16 case
stops with ReferenceUnreliable (the same-dtype torch reference itself is outside the fp16
limits there), a property of that case, not of the route.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# imported once here: pytester's in-process runs drop modules they import, and datasets
# cannot be imported twice in one process (pyarrow extension types are registered globally)
pytest.importorskip("datasets")

# the outside project's plugin module: the shared plain-torch attention, then its routes
ROUTES = Path(__file__).with_name("outside_attention.py").read_text() + '''
from dflash_kernels import gemm as G
from pytest_dflash import Route
from pytest_dflash.engines.geometry import Geometry


class Gemm:
    """gemm.nvfp4 contract: M <= small_max_m rows on ``small``, more on ``large``."""

    def __init__(self, name, small, large, small_max_m=8, out_error=1.0):
        self.name, self.small, self.large = name, small, large
        self.small_max_m, self.out_error = small_max_m, out_error

    def prepare(self, w):
        return self.small.prepare(w)  # both shipped kernels read the same QPN buffer

    def _pick(self, x):
        hits.record(self.name, "dispatch")
        return self.small if x.shape[0] <= self.small_max_m else self.large

    def linear(self, x, prepared):
        return self._pick(x).linear(x, prepared) * self.out_error

    def gate_up(self, x, prepared):
        return self._pick(x).gate_up(x, prepared) * self.out_error


MINE_GEOMETRY = Geometry("prefill.geometry.mine", torch.float32, 6592)
INT8_STATE = Geometry("prefill.geometry.int8_state", torch.int8, 3296)
BOOL_STATE = Geometry("prefill.geometry.bool_state", torch.bool, 3296)
ATTN_MINE = Attention("attn.d256.mine")
ATTN_WRONGSCALE = Attention("attn.d256.wrongscale", scale_error=1.01)
GEMM_MINE = Gemm("gemm.nvfp4.mine", G.QPN2, G.QPN4_BOUNDED)
GEMM_OFFSCALE = Gemm("gemm.nvfp4.offscale", G.QPN2, G.QPN4_BOUNDED, out_error=1.01)
GEMM_LARGE_VERIFY = Gemm("gemm.nvfp4.large_verify", G.QPN2, G.QPN4_BOUNDED, small_max_m=0)


def candidate(name, gates, attr):
    family = name.rsplit(".", 1)[0]
    baseline = {"attn.d256": "attn.d256.sdpa", "gemm.nvfp4": "gemm.nvfp4.turbomind",
                "prefill.geometry": "prefill.geometry.fp32_q3296"}[family]
    return Route(name, family, "candidate", baseline=baseline, gates=gates,
                 impl=f"outside_routes:{attr}")


def pytest_dflash_routes(registry):
    for route in (
        candidate("attn.d256.mine", ("parity", "ppl"), "ATTN_MINE"),
        candidate("attn.d256.wrongscale", ("parity",), "ATTN_WRONGSCALE"),
        candidate("gemm.nvfp4.mine", ("validation_cost", "ppl"), "GEMM_MINE"),
        candidate("gemm.nvfp4.offscale", ("parity", "ppl"), "GEMM_OFFSCALE"),
        candidate("gemm.nvfp4.large_verify", ("validation_cost",), "GEMM_LARGE_VERIFY"),
        candidate("prefill.geometry.mine", ("ppl", "quality"), "MINE_GEOMETRY"),
        candidate("prefill.geometry.int8_state", ("ppl",), "INT8_STATE"),
        candidate("prefill.geometry.bool_state", ("quality",), "BOOL_STATE"),
    ):
        registry.register(route)
'''

# route -> (gate kind it faces, expected gate status)
EXPECTED = {
    # the model-level gates serve attention and GEMM routes from outside too
    "attn.d256.mine": {"parity": "passed", "ppl": "passed"},
    "attn.d256.wrongscale": {"parity": "failed"},
    "gemm.nvfp4.mine": {"validation_cost": "passed", "ppl": "passed"},
    "gemm.nvfp4.offscale": {"parity": "failed", "ppl": "failed"},
    "gemm.nvfp4.large_verify": {"validation_cost": "failed"},
    # two tasks give the quality gate no power: pending (inconclusive), never a pass
    "prefill.geometry.mine": {"ppl": "passed", "quality": "pending"},
    "prefill.geometry.int8_state": {"ppl": "failed"},
    "prefill.geometry.bool_state": {"quality": "failed"},
}


# no timing decision here: at the quick profile the engine-level validation_cost test checks
# the verify steps' route hits and logits, and the op-level test that times every M is -k'd
# out, so it runs beside the other xdist worker
def test_outside_routes_face_every_gate_and_each_defect_is_caught(
        pytester: pytest.Pytester) -> None:
    from pytest_dflash.engines.data import LONG_FILE, PPL_FILE, TASKS_FILE, data_dir

    pytester.makepyfile(outside_routes=ROUTES)
    pytester.syspathinsert()
    # small data (two segments, two tasks) and 64-token completions keep the runtime short;
    # a defect whose completions never end on their own is still caught: 2/2 ended -> 0/2
    data = pytester.mkdir("data")
    for name in (PPL_FILE, LONG_FILE, TASKS_FILE):
        lines = (data_dir() / name).read_text().splitlines()[:2]
        (data / name).write_text("\n".join(lines) + "\n")
    pytester.makepyprojecttoml("[tool.pytest-dflash]\nquality_max_new_tokens = 64\n")
    report = pytester.path / "outside-report.json"
    selected = [arg for name in EXPECTED for arg in ("--dflash-route", name)]
    result = pytester.runpytest(
        "-p", "outside_routes", "--pyargs", "dflash_suites", *selected,
        "-m", "parity or validation_cost or ppl or quality",
        # the op-level validation-cost test times every M (machine-dependent); its route-hit
        # check is the same as the engine-level test's, which runs
        "-k", "not test_gemm_validation_cost_verify_m",
        "--dflash-profile", "quick", "--dflash-data", str(data), "--dflash-report", str(report),
        "-p", "no:cacheprovider", "--dflash-every-test")  # each test judges, none settled
    routes = json.loads(report.read_text())["routes"]
    for name, gates in EXPECTED.items():
        for kind, status in gates.items():
            tests = routes[name]["gates"][kind]["tests"]
            outcomes = [t["outcome"] for t in tests]
            assert tests and "error" not in outcomes and "skipped" not in outcomes, (
                f"{name} {kind}: {[(t['outcome'], t['message']) for t in tests]}")
            assert routes[name]["gates"][kind]["status"] == status, (
                f"{name} {kind}: expected {status}, got "
                f"{[(t['outcome'], t['message'][:200]) for t in tests]}")
        expected_verdict = ("accept" if all(s == "passed" for s in gates.values())
                            else "pending" if "failed" not in gates.values() else "reject")
        assert routes[name]["verdict"] == expected_verdict, (name, routes[name]["reasons"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
