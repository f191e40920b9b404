"""Speed gate of family attn.d256 (DESIGN 6 "speed"): candidate vs the family baseline (torch
SDPA), a causal prefill of the profile's length, both in one process, interleaved in a seeded
random order per round, paired ratios with a bootstrap CI (``pytest_dflash.timing.speed_gate``).

A benchmark of a silent fallback is a failed gate, not a slower pass: the candidate is called
through the family contract, which for the native route raises when its ops are not real (the
test fails, it never skips), and the route hits must show that every timed candidate call ran
the candidate and only the candidate.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from pytest_dflash import hits
from pytest_dflash.numerics import check_parity, poison_

pytestmark = pytest.mark.sm70

FAMILY = "attn.d256"
D = 256
HQ, HKV = 4, 1  # the target deployment's attention layer: GQA 4
PROFILE_T = {"quick": (512,), "ci": (2048, 4096), "full": (32768, 65536)}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Only the session profile's sizes are collected: a size of another profile is not a
    skipped test (a skip would leave the gate pending), it simply is not part of this run."""
    if "t" in metafunc.fixturenames:
        from pytest_dflash.plugin import profile_of

        sizes = PROFILE_T[profile_of(metafunc.config)]
        metafunc.parametrize("t", sizes, ids=[f"T{t}" for t in sizes])


@pytest.mark.gate("speed", family=FAMILY)
def test_attn_speed_cold_prefill(dflash_route, dflash_registry, dflash_policy, dflash_device,
                                 dflash_record, t):
    """Causal prefill of T tokens (Hq=4, Hkv=1, D=256; fp32 on CPU, fp16 on GPU): passes only
    if the CI upper bound of candidate/baseline time is below 1 - min_gain."""
    from pytest_dflash.timing import speed_gate

    impl = dflash_route.implementation()
    base_route = dflash_registry.get(dflash_route.baseline)
    base = base_route.implementation()
    dtype = torch.float32 if dflash_device.type == "cpu" else torch.float16
    gen = torch.Generator().manual_seed(dflash_policy.seed + zlib.crc32(f"speed/{t}".encode()))
    q = torch.randn(t, HQ, D, generator=gen).to(dflash_device, dtype)
    k = torch.randn(t, HKV, D, generator=gen).to(dflash_device, dtype)
    v = torch.randn(t, HKV, D, generator=gen).to(dflash_device, dtype)
    out_c, out_b = torch.empty_like(q), torch.empty_like(q)
    scale = D ** -0.5
    calls = {"candidate": 0, "baseline": 0}

    def candidate() -> None:
        calls["candidate"] += 1
        impl.dense(q, k, v, out_c, scale, True)

    def baseline() -> None:
        calls["baseline"] += 1
        base.dense(q, k, v, out_b, scale, True)

    label = f"causal prefill T={t} Hq={HQ} Hkv={HKV} D={D} {str(dtype).removeprefix('torch.')}"
    try:
        with hits.counting() as delta:
            speed_gate(candidate, baseline, policy=dflash_policy, device=dflash_device,
                       record=dflash_record, label=label)
    finally:  # the hits are known once the block has exited
        dflash_record(route_hits=delta.as_json(), calls=dict(calls), shape=label)
    expected = {dflash_route.name: calls["candidate"], base_route.name: calls["baseline"]}
    if delta.by_route() != expected:
        raise AssertionError(
            f"{label}: route hits {delta.as_json()} do not match the timed calls {calls}: the "
            f"candidate must have served every candidate call, and nothing else may have run")
    # what was timed is the attention: one more (untimed) call of each into poisoned buffers
    poison_(out_c)
    poison_(out_b)
    impl.dense(q, k, v, out_c, scale, True)
    base.dense(q, k, v, out_b, scale, True)
    parity = check_parity(out_c, out_b.double(), None, policy=dflash_policy, dtype=dtype,
                          label=f"{label}: candidate output vs baseline")
    assert parity.ok, parity.message()
