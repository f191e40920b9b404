"""Speed gate of family attn.d256 (docs/gates.md, "speed"): candidate vs its baseline (torch
SDPA for the shipped route), a causal prefill of each of the profile's lengths
(``ProfileSizes.attn_speed_t``), both in one process, interleaved in a seeded random order per
round, paired ratios with a bootstrap CI (``pytest_dflash.measure.timing.speed_gate``).

A benchmark of a silent fallback is a failed gate, not a slower pass: the candidate is called
through the family contract, which for the native route raises when its ops are not real (the
test fails, it never skips), and the route hits must show that every timed candidate call ran
the candidate and only the candidate.
"""

from __future__ import annotations

import pytest
import torch

from dflash_suites.support.attn import SCALE, D
from pytest_dflash.measure.numerics import check_parity, poison_
from pytest_dflash.native import hits

pytestmark = pytest.mark.sm70

FAMILY = "attn.d256"
HQ, HKV = 4, 1  # the target deployment's attention layer: GQA 4


@pytest.mark.gate("speed", family=FAMILY, per_size="attn_speed_t")
def test_attn_speed_cold_prefill(dflash_gate, size):
    """Causal prefill of T tokens (Hq=4, Hkv=1, D=256; fp32 on CPU, fp16 on GPU): passes only
    if the CI upper bound of candidate/baseline time is below 1 - min_gain."""
    from pytest_dflash.measure.timing import speed_gate

    t, device, dtype = size, dflash_gate.device, dflash_gate.dtype
    impl, base = dflash_gate.impl, dflash_gate.baseline
    gen = torch.Generator().manual_seed(dflash_gate.seed("speed", t))
    q = torch.randn(t, HQ, D, generator=gen).to(device, dtype)
    k = torch.randn(t, HKV, D, generator=gen).to(device, dtype)
    v = torch.randn(t, HKV, D, generator=gen).to(device, dtype)
    out_c, out_b = torch.empty_like(q), torch.empty_like(q)
    calls = {"candidate": 0, "baseline": 0}

    def candidate() -> None:
        calls["candidate"] += 1
        impl.dense(q, k, v, out_c, SCALE, True)

    def baseline() -> None:
        calls["baseline"] += 1
        base.dense(q, k, v, out_b, SCALE, True)

    label = f"causal prefill T={t} Hq={HQ} Hkv={HKV} D={D} {str(dtype).removeprefix('torch.')}"
    try:
        with hits.counting() as delta:
            speed_gate(candidate, baseline, policy=dflash_gate.policy, device=device,
                       record=dflash_gate.record, label=label)
    finally:  # the hits are known once the block has exited
        dflash_gate.record(route_hits=delta.as_json(), calls=dict(calls), shape=label)
    expected = {dflash_gate.route.name: calls["candidate"],
                dflash_gate.baseline_route.name: calls["baseline"]}
    if delta.by_route() != expected:
        raise AssertionError(
            f"{label}: route hits {delta.as_json()} do not match the timed calls {calls}: the "
            f"candidate must have served every candidate call, and nothing else may have run")
    # what was timed is the attention: one more (untimed) call of each into poisoned buffers
    poison_(out_c)
    poison_(out_b)
    impl.dense(q, k, v, out_c, SCALE, True)
    base.dense(q, k, v, out_b, SCALE, True)
    parity = check_parity(out_c, out_b.double(), None, policy=dflash_gate.policy, dtype=dtype,
                          label=f"{label}: candidate output vs baseline")
    assert parity.ok, parity.message()
