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

from dflash_suites.support import check_one_call_each, timed_with_hits
from dflash_suites.support.gdn import SpeedPair

pytestmark = pytest.mark.sm70

FAMILY = "linear.gdn"


@pytest.mark.gate("speed", family=FAMILY, per_size="prefill_lengths")
def test_gdn_speed_prefill(dflash_gate, size):
    """Prefill of T tokens (Hk=4, Hv=8, D=128; fp32 on CPU, fp16 on GPU): passes only if the
    CI upper bound of candidate/baseline time is below 1 - min_gain."""
    from pytest_dflash.measure.timing_pool import TimingJob

    pair = SpeedPair(dflash_gate, size)
    # what is timed computes the baseline's result, and the candidate's own chunk code served it
    check_one_call_each(pair, dflash_gate, op="chunk")
    job = TimingJob("dflash_suites.support.gdn:speed_pair",
                    {"route": dflash_gate.route.name, "t": size})
    timed_with_hits(pair, dflash_gate, job, op="chunk")
