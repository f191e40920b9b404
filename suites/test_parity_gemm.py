"""Parity gates of family gemm.nvfp4 (docs/gates.md, "parity").

Every candidate is called through the family contract (``prepare`` / ``linear`` / ``gate_up``,
``pytest_dflash.routes.families.GemmNvfp4``), so a route registered by another project is gated
exactly
like a shipped one:

- type B, every candidate: against the fp64 oracle with the three-way rule (reference = the
  candidate's baseline in the same dtype) and relative L2, on the target deployment's layer
  shapes scaled to the profile, odd M at the contract edges with padded N, and weights of tiny
  and large magnitude (fp16 pre-scaled scales underflow without the 2^14 bias / overflow fp16
  and must fall back to the raw form);
- type A, the shipped qpn2_packed route only: bitwise equal to qpn4_bounded at large M and to
  qpn2 at M <= 8, since it must run the very same code paths; and its QPN2 and QPN4 views are
  one buffer.

Every call must record route hits under the candidate's route name: a candidate that silently
fell back to another route fails here rather than passing with someone else's numbers. The
shipped kernels run with their scratch, workspace and output buffers poisoned (NaN) first, so
an element a kernel forgot to write cannot pass with a stale plausible value.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dflash_kernels.gemm import FAMILY, MAX_VERIFY_M
from dflash_kernels.nvfp4 import NVFP4Weight
from dflash_suites.support import ParityLog
from dflash_suites.support.gemm import (
    ODD_M,
    ODD_SHAPE,
    TARGET_LAYERS,
    ScaledReference,
    gate_parity_case,
    large_m,
    layer_shape,
    make_weight,
    make_x,
    parity_case,
)
from pytest_dflash.measure.numerics import assert_bitwise_equal
from pytest_dflash.native import hits

pytestmark = pytest.mark.sm70


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("layer", list(TARGET_LAYERS))
def test_gemm_parity_layers(dflash_gate, layer):
    """Target layer shapes (scaled for the profile) at the prefill chunk M, fp32 and fp16;
    the fused gate/up layer through gate_up, the others through linear."""
    k, n = layer_shape(layer, dflash_gate.profile)
    m = large_m(dflash_gate.profile)
    w = make_weight(n, k, seed=dflash_gate.seed(layer, "w"), device=dflash_gate.device)
    log = ParityLog(dflash_gate.record)
    for dtype in (torch.float32, torch.float16):
        x = make_x(m, k, seed=dflash_gate.seed(layer, "x"), dtype=dtype,
                   device=dflash_gate.device)
        log.add(gate_parity_case(dflash_gate, w, x, gated=layer == "gate_up",
                                 label=f"{layer} M={m} K={k} N={n} {dtype}"))
    log.finish()


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("m", [*ODD_M, "large"])
def test_gemm_parity_odd_m(dflash_gate, m):
    """Odd M around every path boundary, N padded to the 32-column tile; linear and gate_up."""
    rows = large_m(dflash_gate.profile) if m == "large" else m
    k, n = ODD_SHAPE
    w = make_weight(n, k, seed=dflash_gate.seed("odd", "w"), device=dflash_gate.device)
    log = ParityLog(dflash_gate.record)
    for dtype in (torch.float32, torch.float16):
        x = make_x(rows, k, seed=dflash_gate.seed("odd", rows), dtype=dtype,
                   device=dflash_gate.device)
        for gated in (False, True):
            label = f"M={rows} K={k} N={n} {'gate_up' if gated else 'linear'} {dtype}"
            log.add(gate_parity_case(dflash_gate, w, x, gated=gated, label=label))
    log.finish()


# weight magnitude, activation magnitude: outputs stay inside fp16's normal range
MAGNITUDES = {
    # e4m3 * global ~ 3e-8 < fp16's smallest subnormal: the fp16 pre-scaled form needs its bias
    "tiny": (1e-7, 1e3),
    # e4m3 * global * 2^14 > 65504: the fp16 pre-scaled form overflows; raw E4M3 must be used
    "large": (50.0, 1e-2),
}
SCALED_REFERENCE = ScaledReference()


@pytest.mark.gate("parity", family=FAMILY)
@pytest.mark.parametrize("magnitude", list(MAGNITUDES))
def test_gemm_parity_weight_magnitude(dflash_gate, magnitude):
    """Global scales far from 1 in both directions, at small and large M: a route that
    mishandles the global scale or the fp16 scale form fails by orders of magnitude. The
    same-dtype reference is the unit-scaled one (the family baseline underflows here)."""
    w_mag, x_mag = MAGNITUDES[magnitude]
    k, n = layer_shape("down", dflash_gate.profile)
    w = make_weight(n, k, seed=dflash_gate.seed(magnitude, "w"), device=dflash_gate.device,
                    magnitude=w_mag)
    log = ParityLog(dflash_gate.record)
    for rows in (MAX_VERIFY_M, large_m(dflash_gate.profile)):
        for dtype in (torch.float32, torch.float16):
            x = make_x(rows, k, seed=dflash_gate.seed(magnitude, rows), dtype=dtype,
                       device=dflash_gate.device, magnitude=x_mag)
            label = f"{magnitude} weights M={rows} K={k} N={n} {dtype}"
            log.add(parity_case(dflash_gate.route.name, dflash_gate.impl, dflash_gate.oracle,
                                SCALED_REFERENCE, w, x, gated=False, policy=dflash_gate.policy,
                                label=label))
    log.finish()


# ---------------------------------------------------------------------------------- type A
# Route-specific gates of the shipped dispatch route: it claims to run the very code paths of
# two other shipped routes, so these tests name them (a generic gate never names a route).

PACKED = f"{FAMILY}.qpn2_packed"
LARGE_M_PARTNER = f"{FAMILY}.qpn4_bounded"
SMALL_M_PARTNER = f"{FAMILY}.qpn2"


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
def test_qpn2_packed_bitwise_equals_qpn4_bounded_at_large_m(dflash_gate, layer):
    """Type A: the large-M branch of the dispatch op IS the bounded QPN4 path."""
    impl, device = dflash_gate.impl, dflash_gate.device
    partner = dflash_gate.implementation(LARGE_M_PARTNER)
    k, n = layer_shape(layer, dflash_gate.profile)
    w = make_weight(n, k, seed=dflash_gate.seed("typeA", layer), device=device)
    cases = 0
    for rows in sorted({impl.min_prefill_m, 33, large_m(dflash_gate.profile) + 1}):
        for dtype in (torch.float32, torch.float16):
            x = make_x(rows, k, seed=dflash_gate.seed("typeA", layer, rows), dtype=dtype,
                       device=device)
            _bitwise_pair(dflash_gate.route.name, impl, partner, w, x, gated=layer == "gate_up",
                          label=f"{layer} M={rows} {dtype}", expect_path="large_m")
            cases += 1
    peak, bound = impl.workspace_peak_bytes(device), impl.workspace_bytes
    dflash_gate.record(figure=f"bitwise equal in {cases} cases, max_abs 0", max_abs=0.0,
                       workspace_peak_bytes=peak, workspace_bound_bytes=bound)
    assert 0 < peak <= bound, f"shared workspace peak {peak} bytes outside (0, {bound}]"


@pytest.mark.gate("parity", route=PACKED)
def test_qpn2_packed_bitwise_equals_qpn2_at_verify_m(dflash_gate):
    """Type A: M <= 8 (verify steps) runs the unchanged QPN2 path, bit for bit."""
    impl, device = dflash_gate.impl, dflash_gate.device
    partner = dflash_gate.implementation(SMALL_M_PARTNER)
    k, n = layer_shape("gate_up", dflash_gate.profile)
    w = make_weight(n, k, seed=dflash_gate.seed("typeA", "verify"), device=device)
    cases = 0
    for rows in range(1, MAX_VERIFY_M + 1):
        for dtype in (torch.float32, torch.float16):
            x = make_x(rows, k, seed=dflash_gate.seed("typeA", rows), dtype=dtype, device=device)
            for gated in (False, True):
                _bitwise_pair(dflash_gate.route.name, impl, partner, w, x, gated=gated,
                              label=f"M={rows} {dtype} gated={gated}", expect_path="small_m")
                cases += 1
    dflash_gate.record(figure=f"bitwise equal in {cases} cases, max_abs 0", max_abs=0.0)


@pytest.mark.gate("parity", route=PACKED)
def test_qpn2_packed_views_are_one_buffer(dflash_gate):
    """QPN2 and QPN4 are the same bytes: the prefill path adds no resident weight copy."""
    k, n = layer_shape("gate_up", dflash_gate.profile)
    w = make_weight(n, k, seed=dflash_gate.seed("views"), device=dflash_gate.device)
    prepared = dflash_gate.impl.prepare(w)
    qpn2, qpn4 = prepared.qpn2, prepared.qpn4
    n_padded = -(-n // 32) * 32
    assert tuple(qpn2.shape) == (n_padded, k // 2)
    assert tuple(qpn4.shape) == (k, n_padded // 2)
    assert qpn2.data_ptr() == qpn4.data_ptr()
    assert qpn2.untyped_storage().data_ptr() == qpn4.untyped_storage().data_ptr()
    resident = prepared.buffer.numel() + prepared.scales.numel()
    packed = w.packed.numel() + w.scales.numel()
    dflash_gate.record(figure=f"one buffer, {resident} resident bytes for {packed} NVFP4 bytes",
                       resident_bytes=resident, nvfp4_bytes=packed)
    assert resident == packed * n_padded // n, "resident form holds more than one code buffer"
