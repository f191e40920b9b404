"""Speed gates of family gemm.nvfp4: the prefill projections at large M (docs/gates.md, "speed").

The target deployment's evidence was a projection microbenchmark at M = 3296 (fused gate/up
5120 x 8704 and down 4352 x 5120); these gates time the same two projections, scaled for the
profile, candidate against its baseline, paired and interleaved through
``pytest_dflash.measure.timing.speed_gate``. The same pair is also measured through
pytest-benchmark's
``benchmark`` fixture (a separate test) so its JSON output and ``pytest-benchmark compare`` work
on these runs as well.

A speed-up is only evidence for a route that (a) really ran, shown by its route hits, and
(b) computed the right thing: each test checks the candidate's output against the oracle
first, because a fast wrong kernel is not a faster route.
"""

from __future__ import annotations

import pytest

from dflash_kernels.gemm import FAMILY
from dflash_suites.support.gemm import GemmPair, check_workspace
from pytest_dflash.native import hits

pytestmark = pytest.mark.sm70

SPEED_LAYERS = ("gate_up", "down")


@pytest.mark.gate("speed", family=FAMILY)
@pytest.mark.parametrize("layer", SPEED_LAYERS)
def test_gemm_speed_large_m(dflash_gate, layer):
    """Paired, interleaved candidate/baseline ratio; passes only on a real gain."""
    from pytest_dflash.measure.timing import speed_gate
    from pytest_dflash.measure.timing_pool import TimingJob

    pair = GemmPair(dflash_gate, layer)
    pair.check_output()
    job = TimingJob("dflash_suites.support.gemm:speed_pair",
                    {"route": dflash_gate.route.name, "layer": layer})
    with hits.counting() as delta:
        try:
            speed_gate(pair.candidate, pair.reference, policy=dflash_gate.policy,
                       device=dflash_gate.device, record=dflash_gate.record, label=pair.label,
                       job=job, timing=dflash_gate.timing)
        finally:
            measured = pair.workspace()
            dflash_gate.record(route_hits=delta.as_json(), shape=pair.label, **measured)
    name = dflash_gate.route.name
    if delta.route(name) == 0:
        raise AssertionError(f"{pair.label}: {name} recorded no route hits while timed "
                             f"(hits {delta.as_json()}): the timed call was not the route")
    check_workspace(measured)


@pytest.mark.gate("speed", family=FAMILY)
@pytest.mark.parametrize("side", ["candidate", "baseline"])
@pytest.mark.parametrize("layer", SPEED_LAYERS)
def test_gemm_benchmark_large_m(dflash_gate, benchmark, layer, side):
    """The same pair through pytest-benchmark (one side per test, grouped per route and
    layer) so ``--benchmark-json`` / ``pytest-benchmark compare`` see these runs. The gate
    decision is the paired test above; this test fails only on a wrong or unrun route.

    pytest-benchmark times wall clock, so on CUDA each timed call ends with a device
    synchronize (``timing.synchronized``): an unsynchronised call would time its launch only."""
    from pytest_dflash.measure.timing import synchronized

    pair = GemmPair(dflash_gate, layer)
    pair.check_output()
    fn = synchronized(pair.candidate if side == "candidate" else pair.reference,
                      dflash_gate.device)
    measured_route = (dflash_gate.route if side == "candidate" else dflash_gate.baseline_route).name
    benchmark.group = f"{dflash_gate.route.name} {pair.label}"
    benchmark.extra_info.update(route=measured_route, side=side, shape=pair.label)
    with hits.counting() as delta:
        benchmark.pedantic(fn, rounds=dflash_gate.sizes.benchmark_rounds, iterations=1,
                           warmup_rounds=1)
    stats = getattr(benchmark, "stats", None)
    median = stats.stats.median if stats is not None else None
    dflash_gate.record(
        figure=f"{side} {pair.label}: median {median * 1e3:.3f} ms" if median else f"{side} ran",
        benchmark_median_s=median, route_hits=delta.as_json(), **pair.workspace(),
    )
    if delta.route(measured_route) == 0:
        raise AssertionError(f"{pair.label}: {measured_route} recorded no route hits in the "
                             f"benchmark (hits {delta.as_json()})")
