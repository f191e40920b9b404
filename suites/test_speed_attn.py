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

from dflash_suites.support import check_one_call_each, timed_with_hits
from dflash_suites.support.attn import SpeedPair

pytestmark = pytest.mark.sm70

FAMILY = "attn.d256"


@pytest.mark.gate("speed", family=FAMILY, per_size="attn_speed_t")
def test_attn_speed_cold_prefill(dflash_gate, size):
    """Causal prefill of T tokens (Hq=4, Hkv=1, D=256; fp32 on CPU, fp16 on GPU): passes only
    if the CI upper bound of candidate/baseline time is below 1 - min_gain."""
    from pytest_dflash.measure.timing_pool import TimingJob

    pair = SpeedPair(dflash_gate, size)
    # what is timed must be the candidate computing the baseline's result; checked first, in
    # this process, so a route that cannot run the shape here says so (a skip) before any
    # worker times it
    check_one_call_each(pair, dflash_gate)
    job = TimingJob("dflash_suites.support.attn:speed_pair",
                    {"route": dflash_gate.route.name, "t": size})
    timed_with_hits(pair, dflash_gate, job)
