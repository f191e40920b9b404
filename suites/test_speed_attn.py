"""Speed gate of family attn.d256 (docs/gates.md, "speed"): candidate vs its baseline (torch
SDPA for the shipped route), a causal prefill of each of the profile's lengths
(``ProfileSizes.attn_speed_t``), timed in the run's timing worker processes, interleaved in a
balanced order, the interval computed across processes
(``pytest_dflash.measure.timing.speed_gate``).

A benchmark of a silent fallback is a failed gate, not a slower pass: the candidate is called
through the family contract, which for the native route raises when its ops are not real (the
test fails, it never skips), and the route hits must show that every timed candidate call ran
the candidate and only the candidate.
"""

from __future__ import annotations

import pytest

from dflash_suites.support.attn import SpeedPair
from pytest_dflash.native import hits

pytestmark = pytest.mark.sm70

FAMILY = "attn.d256"


@pytest.mark.gate("speed", family=FAMILY, per_size="attn_speed_t")
def test_attn_speed_cold_prefill(dflash_gate, size):
    """Causal prefill of T tokens (Hq=4, Hkv=1, D=256; fp32 on CPU, fp16 on GPU): passes only
    if the CI upper bound of candidate/baseline time is below 1 - min_gain."""
    from pytest_dflash.measure.timing import speed_gate
    from pytest_dflash.measure.timing_pool import TimingJob

    pair = SpeedPair(dflash_gate, size)
    name, base = dflash_gate.route.name, dflash_gate.baseline_route.name
    # what is timed must be the candidate computing the baseline's result; checked first, in
    # this process, so a route that cannot run the shape here says so (a skip) before any
    # worker times it. A silent fallback is named by its hits before its output is judged.
    with hits.counting() as checked:
        try:
            pair.check_output(dflash_gate.policy)
            wrong = None
        except AssertionError as exc:
            wrong = exc
    served = checked.by_route()
    if not served.get(name) or set(served) - {name, base}:
        raise AssertionError(
            f"{pair.label}: route hits {checked.as_json()} do not match the timed calls "
            f"(one call of each side, before timing): the candidate must have served every "
            "candidate call, and nothing else may have run")
    if wrong is not None:
        raise wrong
    job = TimingJob("dflash_suites.support.attn:speed_pair",
                    {"route": dflash_gate.route.name, "t": size})
    measured: dict = {}
    try:
        with hits.counting() as delta:
            speed_gate(pair.candidate, pair.baseline, policy=dflash_gate.policy,
                       device=dflash_gate.device, record=measured.update, label=pair.label,
                       job=job, timing=dflash_gate.timing)
    finally:  # the hits are known once the block has exited
        dflash_gate.record(**measured, route_hits=delta.as_json(), shape=pair.label)
    ran = delta.by_route()
    if "processes" in measured:  # timed in workers: exactly the timed calls, both sides
        timed = sum(p["info"]["timed_calls"] for p in measured["processes"])
        expected = {name: timed, base: timed}
    else:  # timed here (no timing pool): warm-up and calibration calls are counted too
        expected = {name: ran.get(name, 0), base: ran.get(base, 0)}
    if ran != expected or not ran.get(name):
        raise AssertionError(
            f"{pair.label}: route hits {delta.as_json()} do not match the timed calls "
            f"{expected}: the candidate must have served every candidate call, and nothing "
            "else may have run")
