"""Parity gates of family gemm.nvfp4 (DESIGN 5 "Parity classes", DESIGN 6 "parity").

Every candidate is called through the family contract (``prepare`` / ``linear`` / ``gate_up``,
see ``dflash_kernels.gemm``), so a route registered by another project is gated exactly like
a shipped one:

- type B, every candidate: against the fp64 oracle with the three-way rule (reference = the
  family baseline turbomind in the same dtype) and relative L2, on the target deployment's
  layer shapes scaled to the profile, odd M at the contract edges with padded N, and weights
  of tiny and large magnitude (fp16 pre-scaled scales underflow without the 2^14 bias /
  overflow fp16 and must fall back to the raw form);
- type A, the shipped qpn2_packed route only: bitwise equal to qpn4_bounded at large M and to
  qpn2 at M <= 8, since it must run the very same code paths; and its QPN2 and QPN4 views are
  one buffer.

Every call must record route hits under the candidate's route name: a candidate that silently
fell back to another route fails here rather than passing with someone else's numbers. The
shipped kernels run with their scratch, workspace and output buffers poisoned (NaN) first, so
an element a kernel forgot to write cannot pass with a stale plausible value.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dflash_kernels.gemm import FAMILY, MAX_VERIFY_M, as_gemm_route, poisoned_buffers
from dflash_kernels.nvfp4 import NVFP4Weight, quantize
from pytest_dflash import hits
from pytest_dflash.numerics import ParityResult, assert_bitwise_equal, check_parity
from pytest_dflash.policy import Policy

pytestmark = pytest.mark.sm70

# (K, N) of the target deployment's projections (DESIGN 5 / 8) and its prefill chunk M (Q3296).
TARGET_LAYERS: dict[str, tuple[int, int]] = {
    "gate_up": (5120, 8704),
    "down": (4352, 5120),
    "qkv": (5120, 3584),
    "o": (1536, 5120),
}
TARGET_M = 3296
# Linear scale-down per profile: full = GPU sizes, ci = the whole matrix on a 2-core CPU.
PROFILE_DIVISOR = {"full": 1, "ci": 8, "quick": 32}
# Odd M at the contract edges: every verify width, one past it, one past the QPN2 block of 32.
ODD_M = (*range(1, MAX_VERIFY_M + 1), MAX_VERIFY_M + 1, 33)
# A padded, fused-able N (45 + 45 rows, padded to 96) for the odd-M cases.
ODD_SHAPE = (128, 90)


def layer_shape(layer: str, profile: str) -> tuple[int, int]:
    """(K, N) of a target layer scaled for ``profile``: K rounded up to the QPN K % 64
    contract, N scaled down; the fused gate/up N stays twice the down projection's K, so
    the MLP still chains (full: 8704 = 2 x 4352)."""
    if layer == "gate_up":
        k = layer_shape("qkv", profile)[0]
        return k, 2 * layer_shape("down", profile)[0]
    k, n = TARGET_LAYERS[layer]
    div = PROFILE_DIVISOR[profile]
    return math.ceil(k / div / 64) * 64, n // div


def large_m(profile: str) -> int:
    return TARGET_M // PROFILE_DIVISOR[profile]


def case_seed(policy: Policy, *parts: object) -> int:
    """A seed fixed by the policy seed and the case name, so every case has its own inputs
    and every run (and rerun of one node id) sees the same ones."""
    return (policy.seed + zlib.crc32("/".join(map(str, parts)).encode())) % 2**31


def make_weight(
    n: int, k: int, *, seed: int, device: torch.device, magnitude: float = 0.05
) -> NVFP4Weight:
    gen = torch.Generator().manual_seed(seed)
    return quantize((torch.randn(n, k, generator=gen) * magnitude).to(device))


def make_x(
    m: int, k: int, *, seed: int, dtype: torch.dtype, device: torch.device,
    magnitude: float = 1.0,
) -> torch.Tensor:
    """Seeded activations with no exact zeros (a zero hides a wrong weight)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x = torch.where(x == 0, torch.full_like(x, 0.5), x) * magnitude
    return x.to(device=device, dtype=dtype)


def parity_case(
    route_name: str,
    impl: Any,
    oracle: Any,
    reference: Any,
    w: NVFP4Weight,
    x: torch.Tensor,
    *,
    gated: bool,
    policy: Policy,
    label: str,
) -> ParityResult:
    """Run one case through the family contract and judge it (type B).

    Raises AssertionError when the candidate recorded no route hits or returned the wrong
    shape or dtype; returns the ParityResult otherwise (the caller decides and records).
    """
    call = "gate_up" if gated else "linear"
    prepared = impl.prepare(w)
    with hits.counting() as delta, poisoned_buffers():
        out = getattr(impl, call)(x, prepared)
    if delta.route(route_name) == 0:
        raise AssertionError(
            f"{label}: {route_name} recorded no route hits (got {delta.as_json()}): the call "
            "did not run the candidate (silent fallback?)"
        )
    n_out = w.n // 2 if gated else w.n
    if tuple(out.shape) != (x.shape[0], n_out) or out.dtype != x.dtype:
        raise AssertionError(
            f"{label}: {call} returned {tuple(out.shape)} {out.dtype}, expected "
            f"{(x.shape[0], n_out)} {x.dtype}"
        )
    expected = getattr(oracle, call)(x.double(), oracle.prepare(w))
    ref = getattr(reference, call)(x, reference.prepare(w))
    return check_parity(out, expected, ref, policy=policy, dtype=x.dtype, label=label)


class ParityLog:
    """Collects the cases of one gate test; fails with every failing case's message and
    records the worst case (largest rel L2 relative to its limit) as the test's figure."""

    def __init__(self, record: Callable[..., None]) -> None:
        self.record = record
        self.results: list[ParityResult] = []

    def add(self, result: ParityResult) -> None:
        self.results.append(result)

    def finish(self) -> None:
        worst = max(self.results, key=lambda r: r.rel_l2 / r.rel_l2_limit)
        self.record(
            figure=f"worst {worst.label}: {worst.figure()}",
            worst=worst.measurements(),
            cases=[r.measurements() for r in self.results],
        )
        failed = [r.message() for r in self.results if not r.ok]
        if failed:
            raise AssertionError(
                f"{len(failed)}/{len(self.results)} parity cases failed:\n" + "\n".join(failed)
            )


def _family_routes(route, registry) -> tuple[Any, Any, Any]:
    impl = as_gemm_route(route.implementation(), route.name)
    oracle = registry.role(FAMILY, "oracle").implementation()
    reference = registry.role(FAMILY, "baseline").implementation()
    return impl, oracle, reference


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("layer", list(TARGET_LAYERS))
def test_gemm_parity_layers(dflash_route, dflash_registry, dflash_policy, dflash_profile,
                            dflash_device, dflash_record, layer):
    """Target layer shapes (scaled for the profile) at the prefill chunk M, fp32 and fp16;
    the fused gate/up layer through gate_up, the others through linear."""
    impl, oracle, reference = _family_routes(dflash_route, dflash_registry)
    k, n = layer_shape(layer, dflash_profile)
    m = large_m(dflash_profile)
    w = make_weight(n, k, seed=case_seed(dflash_policy, layer, "w"), device=dflash_device)
    log = ParityLog(dflash_record)
    for dtype in (torch.float32, torch.float16):
        x = make_x(m, k, seed=case_seed(dflash_policy, layer, "x"), dtype=dtype,
                   device=dflash_device)
        label = f"{layer} M={m} K={k} N={n} {dtype}"
        log.add(parity_case(dflash_route.name, impl, oracle, reference, w, x,
                            gated=layer == "gate_up", policy=dflash_policy, label=label))
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("m", [*ODD_M, "large"])
def test_gemm_parity_odd_m(dflash_route, dflash_registry, dflash_policy, dflash_profile,
                           dflash_device, dflash_record, m):
    """Odd M around every path boundary, N padded to the 32-column tile; linear and gate_up."""
    impl, oracle, reference = _family_routes(dflash_route, dflash_registry)
    rows = large_m(dflash_profile) if m == "large" else m
    k, n = ODD_SHAPE
    w = make_weight(n, k, seed=case_seed(dflash_policy, "odd", "w"), device=dflash_device)
    log = ParityLog(dflash_record)
    for dtype in (torch.float32, torch.float16):
        x = make_x(rows, k, seed=case_seed(dflash_policy, "odd", rows), dtype=dtype,
                   device=dflash_device)
        for gated in (False, True):
            label = f"M={rows} K={k} N={n} {'gate_up' if gated else 'linear'} {dtype}"
            log.add(parity_case(dflash_route.name, impl, oracle, reference, w, x,
                                gated=gated, policy=dflash_policy, label=label))
    log.finish()


# weight magnitude, activation magnitude: outputs stay inside fp16's normal range
MAGNITUDES = {
    # e4m3 * global ~ 3e-8 < fp16's smallest subnormal: the fp16 pre-scaled form needs its bias
    "tiny": (1e-7, 1e3),
    # e4m3 * global * 2^14 > 65504: the fp16 pre-scaled form overflows; raw E4M3 must be used
    "large": (50.0, 1e-2),
}


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("magnitude", list(MAGNITUDES))
def test_gemm_parity_weight_magnitude(dflash_route, dflash_registry, dflash_policy,
                                      dflash_profile, dflash_device, dflash_record, magnitude):
    """Global scales far from 1 in both directions, at small and large M: a route that
    mishandles the global scale or the fp16 scale form fails by orders of magnitude."""
    impl, oracle, reference = _family_routes(dflash_route, dflash_registry)
    w_mag, x_mag = MAGNITUDES[magnitude]
    k, n = layer_shape("down", dflash_profile)
    w = make_weight(n, k, seed=case_seed(dflash_policy, magnitude, "w"), device=dflash_device,
                    magnitude=w_mag)
    log = ParityLog(dflash_record)
    for rows in (MAX_VERIFY_M, large_m(dflash_profile)):
        for dtype in (torch.float32, torch.float16):
            x = make_x(rows, k, seed=case_seed(dflash_policy, magnitude, rows), dtype=dtype,
                       device=dflash_device, magnitude=x_mag)
            label = f"{magnitude} weights M={rows} K={k} N={n} {dtype}"
            log.add(parity_case(dflash_route.name, impl, oracle, reference, w, x,
                                gated=False, policy=dflash_policy, label=label))
    log.finish()


# ---------------------------------------------------------------------------------- type A

PACKED = f"{FAMILY}.qpn2_packed"


def _bitwise_pair(route_name: str, impl: Any, partner: Any, w: NVFP4Weight, x: torch.Tensor,
                  *, gated: bool, label: str, expect_path: str) -> dict[str, Any]:
    call = "gate_up" if gated else "linear"
    with hits.counting() as delta:
        got = getattr(impl, call)(x, impl.prepare(w))
    if delta.counts.get((route_name, expect_path), 0) == 0:
        raise AssertionError(
            f"{label}: expected {route_name} to take its {expect_path} path, hits were "
            f"{delta.as_json()}"
        )
    want = getattr(partner, call)(x, partner.prepare(w))
    return assert_bitwise_equal(got, want, label)


@pytest.mark.gate("parity", route=PACKED)
@pytest.mark.parametrize("layer", ["gate_up", "down"])
def test_qpn2_packed_bitwise_equals_qpn4_bounded_at_large_m(
    dflash_route, dflash_registry, dflash_policy, dflash_profile, dflash_device, dflash_record,
    layer,
):
    """Type A: the large-M branch of the dispatch op IS the bounded QPN4 path."""
    impl = dflash_route.implementation()
    partner = dflash_registry.get(f"{FAMILY}.qpn4_bounded").implementation()
    k, n = layer_shape(layer, dflash_profile)
    w = make_weight(n, k, seed=case_seed(dflash_policy, "typeA", layer), device=dflash_device)
    cases = 0
    for rows in sorted({impl.min_prefill_m, 33, large_m(dflash_profile) + 1}):
        for dtype in (torch.float32, torch.float16):
            x = make_x(rows, k, seed=case_seed(dflash_policy, "typeA", layer, rows), dtype=dtype,
                       device=dflash_device)
            _bitwise_pair(dflash_route.name, impl, partner, w, x, gated=layer == "gate_up",
                          label=f"{layer} M={rows} {dtype}", expect_path="large_m")
            cases += 1
    peak, bound = impl.workspace_peak_bytes(dflash_device), impl.workspace_bytes
    dflash_record(figure=f"bitwise equal in {cases} cases, max_abs 0", max_abs=0.0,
                  workspace_peak_bytes=peak, workspace_bound_bytes=bound)
    assert 0 < peak <= bound, f"shared workspace peak {peak} bytes outside (0, {bound}]"


@pytest.mark.gate("parity", route=PACKED)
def test_qpn2_packed_bitwise_equals_qpn2_at_verify_m(
    dflash_route, dflash_registry, dflash_policy, dflash_profile, dflash_device, dflash_record,
):
    """Type A: M <= 8 (verify steps) runs the unchanged QPN2 path, bit for bit."""
    impl = dflash_route.implementation()
    partner = dflash_registry.get(f"{FAMILY}.qpn2").implementation()
    k, n = layer_shape("gate_up", dflash_profile)
    w = make_weight(n, k, seed=case_seed(dflash_policy, "typeA", "verify"), device=dflash_device)
    cases = 0
    for rows in range(1, MAX_VERIFY_M + 1):
        for dtype in (torch.float32, torch.float16):
            x = make_x(rows, k, seed=case_seed(dflash_policy, "typeA", rows), dtype=dtype,
                       device=dflash_device)
            for gated in (False, True):
                _bitwise_pair(dflash_route.name, impl, partner, w, x, gated=gated,
                              label=f"M={rows} {dtype} gated={gated}", expect_path="small_m")
                cases += 1
    dflash_record(figure=f"bitwise equal in {cases} cases, max_abs 0", max_abs=0.0)


@pytest.mark.gate("parity", route=PACKED)
def test_qpn2_packed_views_are_one_buffer(dflash_route, dflash_policy, dflash_profile,
                                          dflash_device, dflash_record):
    """QPN2 and QPN4 are the same bytes: the prefill path adds no resident weight copy."""
    impl = dflash_route.implementation()
    k, n = layer_shape("gate_up", dflash_profile)
    w = make_weight(n, k, seed=case_seed(dflash_policy, "views"), device=dflash_device)
    prepared = impl.prepare(w)
    qpn2, qpn4 = prepared.qpn2, prepared.qpn4
    n_padded = -(-n // 32) * 32
    assert tuple(qpn2.shape) == (n_padded, k // 2)
    assert tuple(qpn4.shape) == (k, n_padded // 2)
    assert qpn2.data_ptr() == qpn4.data_ptr()
    assert qpn2.untyped_storage().data_ptr() == qpn4.untyped_storage().data_ptr()
    resident = prepared.buffer.numel() + prepared.scales.numel()
    packed = w.packed.numel() + w.scales.numel()
    dflash_record(figure=f"one buffer, {resident} resident bytes for {packed} NVFP4 bytes",
                  resident_bytes=resident, nvfp4_bytes=packed)
    assert resident == packed * n_padded // n, "resident form holds more than one code buffer"
