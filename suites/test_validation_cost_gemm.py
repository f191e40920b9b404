"""Validation-cost gate of family gemm.nvfp4 (docs/gates.md, "validation_cost").

A large-M prefill route must leave speculative verification untouched: verify steps have
M = 1..8 rows (draft width 7 + 1), served by the route the family declares as its verify route
(``Family.verify_route``). For each M, one verify step through the MLP (fused gate/up, then
down) is run with the candidate enabled and disabled (disabled = the verify route, the
behaviour it must not change):

1. route hits: the kernels that served the step must be identical in both runs. The candidate's
   own dispatch records are set aside (they prove it ran); every other hit must match, so a
   dispatch that sends M <= 8 to its large-M path shows up as extra hits and fails, before any
   timing;
2. cost: paired interleaved timing per M in the run's timing worker processes, the interval
   computed across processes: passing only if every M's CI upper bound is
   <= 1 + policy.validation_noise_floor, failing if some M's lower bound is above it, else
   inconclusive (the route stays pending).

The shared prefill workspace's peak is recorded too: at M <= 8 it must not grow.
The gate's body is ``dflash_suites.support.gemm.run_validation_cost``.
"""

from __future__ import annotations

import pytest

from dflash_kernels.gemm import FAMILY
from dflash_suites.support.gemm import run_validation_cost

pytestmark = pytest.mark.sm70


@pytest.mark.gate("validation_cost", family=FAMILY)
def test_gemm_validation_cost_verify_m(dflash_gate):
    """M = 1..8 verify steps: same kernels and no cost regression with the candidate on."""
    verify = dflash_gate.verify_route
    run_validation_cost(dflash_gate.route.name, dflash_gate.route.implementation(),
                        verify.implementation(), policy=dflash_gate.policy,
                        profile=dflash_gate.profile, device=dflash_gate.device,
                        record=dflash_gate.record, disabled_name=verify.name,
                        timing=dflash_gate.timing)
