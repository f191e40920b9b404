"""Speed gates of family gemm.nvfp4: the prefill projections at large M (DESIGN 6 "speed").

The target deployment's evidence was a projection microbenchmark at M = 3296 (fused gate/up
5120 x 8704 and down 4352 x 5120, DESIGN 8); these gates time the same two projections, scaled
for the profile, candidate against the family baseline (turbomind), paired and interleaved
through ``pytest_dflash.timing.speed_gate``. The same pair is also measured through
pytest-benchmark's ``benchmark`` fixture (a separate test) so its JSON output and
``pytest-benchmark compare`` work on these runs as well.

A speed-up is only evidence for a route that (a) really ran, shown by its route hits, and
(b) computed the right thing: each test checks the candidate's output against the oracle
first, because a fast wrong kernel is not a faster route.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dflash_kernels.gemm import FAMILY, as_gemm_route
from dflash_suites.test_parity_gemm import (
    case_seed,
    large_m,
    layer_shape,
    make_weight,
    make_x,
    parity_case,
)
from pytest_dflash import hits

pytestmark = pytest.mark.sm70

SPEED_LAYERS = ("gate_up", "down")
BENCHMARK_ROUNDS = {"quick": 3, "ci": 10, "full": 30}


def _speed_dtype(device: torch.device) -> torch.dtype:
    """fp16 on the GPU (what ships on SM70), fp32 on the CPU (its native GEMM dtype)."""
    return torch.float16 if device.type == "cuda" else torch.float32


class _Pair:
    """Candidate and baseline prepared once for one layer, as zero-argument calls."""

    def __init__(self, route, registry, policy, profile: str, device: torch.device,
                 layer: str) -> None:
        self.name = route.name
        self.impl = as_gemm_route(route.implementation(), route.name)
        self.baseline = registry.get(route.baseline).implementation()
        self.oracle = registry.role(FAMILY, "oracle").implementation()
        self.k, self.n = layer_shape(layer, profile)
        self.m = large_m(profile)
        self.gated = layer == "gate_up"
        self.label = f"{layer} M={self.m} K={self.k} N={self.n}"
        self.w = make_weight(self.n, self.k, seed=case_seed(policy, "speed", layer),
                             device=device)
        self.x = make_x(self.m, self.k, seed=case_seed(policy, "speed", layer, "x"),
                        dtype=_speed_dtype(device), device=device)
        call = "gate_up" if self.gated else "linear"
        cand_w, base_w = self.impl.prepare(self.w), self.baseline.prepare(self.w)
        impl_call, base_call = getattr(self.impl, call), getattr(self.baseline, call)
        self.candidate = lambda: impl_call(self.x, cand_w)
        self.reference = lambda: base_call(self.x, base_w)

    def check_output(self, policy, reference) -> None:
        result = parity_case(self.name, self.impl, self.oracle, reference, self.w, self.x,
                             gated=self.gated, policy=policy, label=self.label)
        if not result.ok:
            raise AssertionError(f"wrong output, speed not measured: {result.message()}")

    def workspace(self, device: torch.device) -> dict[str, Any]:
        """Peak and bound of the candidate's workspace, when it has one."""
        peak = getattr(self.impl, "workspace_peak_bytes", None)
        if peak is None:
            return {}
        return {"workspace_peak_bytes": peak(device),
                "workspace_bound_bytes": self.impl.workspace_bytes}


def _check_workspace(measured: dict[str, Any]) -> None:
    if measured and not 0 < measured["workspace_peak_bytes"] <= measured["workspace_bound_bytes"]:
        raise AssertionError(f"workspace peak outside (0, bound]: {measured}")


@pytest.mark.gate("speed", family=FAMILY)
@pytest.mark.parametrize("layer", SPEED_LAYERS)
def test_gemm_speed_large_m(dflash_route, dflash_registry, dflash_policy, dflash_profile,
                            dflash_device, dflash_record, layer):
    """Paired, interleaved candidate/turbomind ratio; passes only on a real gain."""
    from pytest_dflash.timing import speed_gate

    pair = _Pair(dflash_route, dflash_registry, dflash_policy, dflash_profile, dflash_device,
                 layer)
    pair.check_output(dflash_policy, pair.baseline)
    with hits.counting() as delta:
        try:
            speed_gate(pair.candidate, pair.reference, policy=dflash_policy,
                       device=dflash_device, record=dflash_record, label=pair.label)
        finally:
            measured = pair.workspace(dflash_device)
            dflash_record(route_hits=delta.as_json(), shape=pair.label, **measured)
    if delta.route(dflash_route.name) == 0:
        raise AssertionError(f"{pair.label}: {dflash_route.name} recorded no route hits while "
                             f"timed (hits {delta.as_json()}): the timed call was not the route")
    _check_workspace(measured)


@pytest.mark.gate("speed", family=FAMILY)
@pytest.mark.parametrize("side", ["candidate", "baseline"])
@pytest.mark.parametrize("layer", SPEED_LAYERS)
def test_gemm_benchmark_large_m(dflash_route, dflash_registry, dflash_policy, dflash_profile,
                                dflash_device, dflash_record, benchmark, layer, side):
    """The same pair through pytest-benchmark (one side per test, grouped per route and
    layer) so ``--benchmark-json`` / ``pytest-benchmark compare`` see these runs. The gate
    decision is the paired test above; this test fails only on a wrong or unrun route."""
    pair = _Pair(dflash_route, dflash_registry, dflash_policy, dflash_profile, dflash_device,
                 layer)
    pair.check_output(dflash_policy, pair.baseline)
    fn = pair.candidate if side == "candidate" else pair.reference
    measured_route = dflash_route.name if side == "candidate" else dflash_route.baseline
    benchmark.group = f"{dflash_route.name} {pair.label}"
    benchmark.extra_info.update(route=measured_route, side=side, shape=pair.label)
    with hits.counting() as delta:
        benchmark.pedantic(fn, rounds=BENCHMARK_ROUNDS[dflash_profile], iterations=1,
                           warmup_rounds=1)
    stats = getattr(benchmark, "stats", None)
    median = stats.stats.median if stats is not None else None
    dflash_record(
        figure=f"{side} {pair.label}: median {median * 1e3:.3f} ms" if median else f"{side} ran",
        benchmark_median_s=median, route_hits=delta.as_json(), **pair.workspace(dflash_device),
    )
    if delta.route(measured_route) == 0:
        raise AssertionError(f"{pair.label}: {measured_route} recorded no route hits in the "
                             f"benchmark (hits {delta.as_json()})")
