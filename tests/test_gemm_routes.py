"""The gemm.nvfp4 routes: contract, route hits, type-A identities, workspace bound, the
qpn2_packed dispatch op, and that the gates' checkers catch broken routes."""

from __future__ import annotations

import pytest
import torch

from dflash_kernels import gemm
from dflash_kernels.gemm import (
    MAX_VERIFY_M,
    ORACLE,
    QPN2,
    QPN2_PACKED,
    QPN4_BOUNDED,
    TURBOMIND,
    QPN2PackedRoute,
    QPN4BoundedRoute,
    as_gemm_route,
    packed_plan,
    shared_workspace,
    workspace_bytes_per_tile,
)
from dflash_kernels.nvfp4 import GLOBAL_DIVISOR, NVFP4Weight, quantize
from dflash_suites.support import check_same_kernels
from dflash_suites.support.gemm import run_validation_cost
from pytest_dflash.measure.numerics import assert_bitwise_equal, check_parity
from pytest_dflash.native import hits
from pytest_dflash.policy.thresholds import Policy

ROUTES = (TURBOMIND, QPN2, QPN4_BOUNDED, QPN2_PACKED)
POLICY = Policy()


def _weight(n: int = 90, k: int = 128, seed: int = 0) -> NVFP4Weight:
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=gen) * 0.05)


def _x(m: int, k: int = 128, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 8, 33, 70])
def test_routes_match_the_oracle(route, dtype, m) -> None:
    w = _weight()
    x = _x(m, dtype=dtype)
    for call in ("linear", "gate_up"):
        out = getattr(route, call)(x, route.prepare(w))
        expected = getattr(ORACLE, call)(x.double(), w)
        reference = getattr(TURBOMIND, call)(x, w)
        assert out.dtype == dtype and out.shape == expected.shape
        result = check_parity(out, expected, reference, policy=POLICY, dtype=dtype,
                              label=f"{route.name} {call}")
        assert result.ok, result.message()


def test_gate_up_is_silu_gate_times_up() -> None:
    w = _weight(n=64)
    x = _x(5)
    full = ORACLE.linear(x.double(), w)
    expected = torch.nn.functional.silu(full[:, :32]) * full[:, 32:]
    assert torch.allclose(ORACLE.gate_up(x.double(), w), expected, rtol=0, atol=0)


def test_wrong_global_convention_is_caught_by_the_parity_check() -> None:
    """A dequant that forgets the / (6 * 448) of the ModelOpt global convention is off by
    about 2688: the checker the parity gates use must fail it, loudly."""
    w = _weight()
    wrong = NVFP4Weight(w.packed, w.scales, w.global_scale * GLOBAL_DIVISOR, w.shape)
    x = _x(33)
    for route in ROUTES:
        out = route.linear(x, route.prepare(wrong))
        result = check_parity(out, ORACLE.linear(x.double(), w), TURBOMIND.linear(x, w),
                              policy=POLICY, dtype=torch.float32, label=route.name)
        assert not result.ok
        assert result.rel_l2 == pytest.approx(GLOBAL_DIVISOR - 1, rel=1e-3)
        assert "parity FAILED" in result.message()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qpn2_packed_is_bitwise_its_partner_on_each_side_of_the_branch(dtype) -> None:
    w = _weight()
    for m in range(1, 41):
        x = _x(m, dtype=dtype, seed=m)
        partner = QPN2 if m < QPN2_PACKED.min_prefill_m else QPN4_BOUNDED
        for call in ("linear", "gate_up"):
            got = getattr(QPN2_PACKED, call)(x, QPN2_PACKED.prepare(w))
            want = getattr(partner, call)(x, partner.prepare(w))
            assert_bitwise_equal(got, want, f"M={m} {call} vs {partner.name}")


def test_qpn2_is_deterministic_run_to_run() -> None:
    w = QPN2.prepare(_weight(k=1024))  # 4 split-K slices
    x = _x(7, k=1024)
    assert_bitwise_equal(QPN2.linear(x, w), QPN2.linear(x, w), "qpn2 twice")


def test_route_hits_name_the_path_that_ran() -> None:
    w = _weight()
    cases = [
        (ORACLE, 3, {("gemm.nvfp4.oracle", "fp64"): 1}),
        (TURBOMIND, 3, {("gemm.nvfp4.turbomind", "dequant"): 1}),
        (QPN2, 3, {("gemm.nvfp4.qpn2", "small_m"): 1}),
        (QPN2, 70, {("gemm.nvfp4.qpn2", "small_m"): 3}),  # blocks of 32 rows
        (QPN4_BOUNDED, 3, {("gemm.nvfp4.qpn4_bounded", "large_m"): 1}),
        (QPN2_PACKED, MAX_VERIFY_M,
         {("gemm.nvfp4.qpn2_packed", "small_m"): 1, ("gemm.nvfp4.qpn2", "small_m"): 1}),
        (QPN2_PACKED, 33,
         {("gemm.nvfp4.qpn2_packed", "large_m"): 1, ("gemm.nvfp4.qpn4_bounded", "large_m"): 1}),
    ]
    for route, m, expected in cases:
        prepared = route.prepare(w)
        with hits.counting() as delta:
            route.linear(_x(m), prepared)
        assert delta.counts == expected, f"{route.name} M={m}"


def test_min_prefill_m_must_exceed_the_verify_width() -> None:
    with pytest.raises(ValueError, match="min_prefill_m > 8"):
        QPN2PackedRoute(min_prefill_m=MAX_VERIFY_M)
    # the op itself checks too: tests/test_qpn_native.py, in a child interpreter (docs/cuda.md)
    assert QPN2PackedRoute(min_prefill_m=9).min_prefill_m == 9


def test_dispatch_branch_is_inside_the_registered_op() -> None:
    w = QPN2_PACKED.prepare(_weight())
    ws = shared_workspace("cpu").id
    for m, path, kernel in ((40, "large_m", "qpn4_bounded"), (32, "small_m", "qpn2")):
        with hits.counting() as delta:
            out = torch.ops.dflash_qpn.qpn2_packed_linear(
                _x(m), w.buffer, w.scales, None, w.n,
                packed_plan(w.k, 33, ws, 2**24, w.global_scale), True)
        assert out.shape == (m, 45)
        assert delta.counts == {("gemm.nvfp4.qpn2_packed", path): 1,
                                (f"gemm.nvfp4.{kernel}", path): 1}


def test_op_registrations_are_cpp_kernels() -> None:
    """No Python between the dispatcher and the kernel: the CPU kernel of every QPN op is
    registered by the C++ source, as the dispatcher's own table says."""
    QPN2.prepare(_weight())  # loads the library
    for op in ("qpn2_linear", "qpn4_bounded_linear", "qpn2_packed_linear"):
        table = torch._C._dispatch_dump(f"dflash_qpn::{op}")
        cpu = next(line for line in table.splitlines() if line.startswith("CPU:"))
        assert "qpn_gemm.cpp" in cpu, table


def test_op_registrations_pass_opcheck() -> None:
    w = QPN2_PACKED.prepare(_weight())
    ops = torch.ops.dflash_qpn
    ws = shared_workspace("cpu").id
    checks = ("test_schema", "test_faketensor")
    for m in (3, 40):
        for scales_fp16 in (None, w.fp16_prescaled_or_none()):
            args = (_x(m, dtype=torch.float16), w.buffer, w.scales, scales_fp16, w.n,
                    packed_plan(w.k, 33, ws, 2**24, w.global_scale), False)
            torch.library.opcheck(ops.qpn2_packed_linear.default, args, test_utils=checks)
    args = (_x(40), w.buffer, w.scales, None, w.global_scale, w.n, w.k, ws, 2**24, True)
    torch.library.opcheck(ops.qpn4_bounded_linear.default, args, test_utils=checks)
    args = (_x(5), w.buffer, w.scales, w.global_scale, w.n, w.k, True)
    torch.library.opcheck(ops.qpn2_linear.default, args, test_utils=checks)


def test_broken_dispatch_fails_the_validation_cost_gate() -> None:
    """min_prefill_m = 1 (only possible through the private testing hook) sends verify steps
    to the large-M path; the gate must fail on route hits, before any timing."""
    with gemm._unchecked_dispatch_for_testing():
        broken = QPN2PackedRoute(min_prefill_m=1)
        with pytest.raises(AssertionError, match="route hits differ") as info:
            run_validation_cost(QPN2_PACKED.name, broken, QPN2, policy=POLICY,
                                profile="quick", device=torch.device("cpu"),
                                record=lambda **kw: None)
    assert "qpn4_bounded/large_m" in str(info.value)


def test_same_kernels_check_accepts_the_real_dispatch() -> None:
    w = _weight()
    x = _x(MAX_VERIFY_M)
    with hits.counting() as enabled:
        QPN2_PACKED.linear(x, QPN2_PACKED.prepare(w))
    with hits.counting() as disabled:
        QPN2.linear(x, QPN2.prepare(w))
    got = check_same_kernels(QPN2_PACKED.name, enabled, disabled, "M=8")
    assert got == {"gemm.nvfp4.qpn2/small_m": 1, "gemm.nvfp4.qpn2_packed/small_m": 1}


def test_bounded_workspace_is_never_exceeded_and_chunks_agree() -> None:
    w = _weight(n=200, k=256)
    x = _x(50, k=256)
    per_tile = workspace_bytes_per_tile(256)
    small = QPN4BoundedRoute(workspace_bytes=2 * per_tile + 100)  # 2 tiles per chunk of 7
    out_small = small.linear(x, small.prepare(w))
    assert small.workspace_peak_bytes() == 2 * per_tile
    big = QPN4BoundedRoute(workspace_bytes=10**8)
    out_big = big.linear(x, big.prepare(w))
    assert big.workspace_peak_bytes() == 7 * per_tile  # the whole padded weight, no more
    assert torch.allclose(out_small, out_big, rtol=1e-6, atol=1e-6)


def test_workspace_bound_below_one_tile_names_the_minimum() -> None:
    """Refused at prepare, before any call: the op (which checks too) never has to raise."""
    for route in (QPN4BoundedRoute(workspace_bytes=1000), QPN2PackedRoute(workspace_bytes=1000)):
        with pytest.raises(ValueError, match=f"at least {workspace_bytes_per_tile(128)}"):
            route.prepare(_weight())


def test_qpn2_packed_shares_one_workspace_per_device() -> None:
    bound = 3 * workspace_bytes_per_tile(256)
    route = QPN2PackedRoute(workspace_bytes=bound)
    layers = [_weight(n=96, k=256, seed=1), _weight(n=160, k=256, seed=2)]
    shared_workspace("cpu").set_bound(bound)
    shared_workspace("cpu").reset_peak()
    for w in layers:
        route.linear(_x(40, k=256), route.prepare(w))
    # one workspace for both layers: its peak is one chunk, not one per layer
    assert route.workspace_peak_bytes() == bound
    assert shared_workspace("cpu") is shared_workspace(torch.device("cpu"))


def test_input_errors_are_clear() -> None:
    w = _weight()
    with pytest.raises(ValueError, match="K = 64 but the weight has K = 128"):
        QPN2.linear(_x(2, k=64), QPN2.prepare(w))
    with pytest.raises(ValueError, match="fp32 or fp16"):
        QPN2.linear(_x(2).bfloat16(), QPN2.prepare(w))
    with pytest.raises(ValueError, match=r"2-D tensor \[M, K\]"):
        QPN2.linear(torch.ones(128), QPN2.prepare(w))
    with pytest.raises(ValueError, match="even N"):
        QPN2.gate_up(_x(2), QPN2.prepare(_weight(n=91)))
    with pytest.raises(TypeError, match="takes an NVFP4Weight"):
        QPN2.prepare(torch.ones(4, 16))
    with pytest.raises(TypeError, match="not from this family's"):
        QPN2.linear(_x(2), w.packed)


def test_outside_routes_must_offer_the_contract() -> None:
    class Half:
        def prepare(self, w):
            return w

        def linear(self, x, prepared):
            return x

    with pytest.raises(TypeError, match="lacks gate_up"):
        as_gemm_route(Half(), "gemm.nvfp4.outside")
    assert as_gemm_route(QPN2, QPN2.name) is QPN2


def test_poisoned_buffers_reach_the_native_kernels_which_overwrite_them() -> None:
    w = _weight()
    x = _x(40)
    expected = {r.name: r.linear(x, r.prepare(w)) for r in (QPN2, QPN4_BOUNDED, QPN2_PACKED)}
    with gemm.poisoned_buffers():
        assert torch.ops.dflash_qpn.set_poison(True) is True  # the library's flag is on
        for route in (QPN2, QPN4_BOUNDED, QPN2_PACKED):
            got = route.linear(x, route.prepare(w))
            assert_bitwise_equal(got, expected[route.name], f"{route.name} poisoned")
    assert torch.ops.dflash_qpn.set_poison(False) is False  # and off again after the block


def test_validation_cost_shares_the_resident_weight_only_between_like_routes() -> None:
    """qpn2_packed keeps qpn2's resident buffer, so the gate times both on one prepared copy;
    a route with its own prepare (turbomind, an outside class) gets a copy of its own."""
    from dflash_suites.support.gemm import shares_resident_weights

    class Outside:
        def prepare(self, w: NVFP4Weight) -> NVFP4Weight:
            return w

    assert shares_resident_weights(QPN2_PACKED, QPN2)
    assert not shares_resident_weights(TURBOMIND, QPN2)
    assert not shares_resident_weights(Outside(), QPN2)
    assert not shares_resident_weights(lambda x, w: x, QPN2)
