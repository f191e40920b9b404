"""Speed gate of family linear.gdn (docs/library-routes.md): the candidate's gated delta rule
over a cold prefill of each of the profile's prefill lengths (``ProfileSizes.prefill_lengths``)
against the baseline's, timed in the run's timing worker processes, interleaved in a balanced
order, the interval computed across processes (``pytest_dflash.measure.timing.speed_gate``).

The route hits must show that every timed candidate call ran the candidate's own chunk code and
every baseline call the baseline's: a route that leaves the prefill to the baseline has nothing
to time.
"""

from __future__ import annotations

import pytest

from dflash_suites.support.gdn import SpeedPair
from pytest_dflash.native import hits

pytestmark = pytest.mark.sm70

FAMILY = "linear.gdn"


@pytest.mark.gate("speed", family=FAMILY, per_size="prefill_lengths")
def test_gdn_speed_prefill(dflash_gate, size):
    """Prefill of T tokens (Hk=4, Hv=8, D=128; fp32 on CPU, fp16 on GPU): passes only if the
    CI upper bound of candidate/baseline time is below 1 - min_gain."""
    from pytest_dflash.measure.timing import speed_gate
    from pytest_dflash.measure.timing_pool import TimingJob

    pair = SpeedPair(dflash_gate, size)
    pair.check_output(dflash_gate.policy)  # what is timed computes the baseline's result
    job = TimingJob("dflash_suites.support.gdn:speed_pair",
                    {"route": dflash_gate.route.name, "t": size})
    measured: dict = {}
    try:
        with hits.counting() as delta:
            speed_gate(pair.candidate, pair.baseline, policy=dflash_gate.policy,
                       device=dflash_gate.device, record=measured.update, label=pair.label,
                       job=job, timing=dflash_gate.timing)
    finally:
        dflash_gate.record(**measured, route_hits=delta.as_json(), shape=pair.label)
    name, base = dflash_gate.route.name, dflash_gate.baseline_route.name
    ran = delta.counts
    if "processes" in measured:  # timed in workers: exactly the timed calls, both sides
        timed = sum(p["info"]["timed_calls"] for p in measured["processes"])
        expected = {(name, "chunk"): timed, (base, "chunk"): timed}
    else:  # timed here: warm-up and calibration calls are counted too
        expected = {(name, "chunk"): ran.get((name, "chunk"), 0),
                    (base, "chunk"): ran.get((base, "chunk"), 0)}
    if dict(ran) != expected or not ran.get((name, "chunk")):
        raise AssertionError(
            f"{pair.label}: route hits {delta.as_json()} do not match the timed calls: the "
            "candidate's own chunk code must have served every candidate call, and nothing "
            "else may have run")
