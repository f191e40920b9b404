"""The native QPN kernels (``torch.ops.dflash_qpn``) against the torch reference, their
determinism, their hit counters, their workspaces (one per device, whatever the spelling) and
their argument errors."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys

import pytest
import torch

from dflash_kernels import qpn_native
from dflash_kernels import qpn_reference as ref
from dflash_kernels.gemm import (
    QPN2,
    QPN2_PACKED,
    QPN2PackedRoute,
    QPN4BoundedRoute,
    shared_workspace,
    workspace_bytes_per_tile,
)
from dflash_kernels.nvfp4 import NVFP4Weight, dequantize, quantize
from pytest_dflash.measure.numerics import assert_bitwise_equal
from pytest_dflash.native import hits


def _weight(n: int, k: int, seed: int = 0, scale: float = 0.05):
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=gen) * scale)


def _x(m: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


# fp32: both sides accumulate in fp32 in different orders; fp16: one fp16 rounding of the output
TOLERANCE = {torch.float32: 2e-6, torch.float16: 1e-3}


@pytest.mark.parametrize("n,k", [(90, 64), (96, 1024), (200, 320)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qpn2_kernel_matches_the_reference(n, k, dtype) -> None:
    """Index math, split-K slices (K = 1024: four; K = 320: a partial one), padded N, every
    row count around the 8-row blocks and the 32-row passes, linear and gated."""
    w = QPN2.prepare(_weight(n, k))
    for m in (1, 2, 5, 8, 9, 31, 32, 33, 70):
        x = _x(m, k, dtype, seed=m)
        for gated in (False, True):
            got = QPN2.gate_up(x, w) if gated else QPN2.linear(x, w)
            want = ref.qpn2_linear(x, w, gated)
            assert got.dtype == dtype and got.shape == want.shape
            assert _rel(got, want) <= TOLERANCE[dtype], f"M={m} gated={gated}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qpn4_bounded_kernel_matches_the_reference_chunk_by_chunk(dtype) -> None:
    """A bound of 2 tiles over a 7-tile weight: four chunks, the last one short."""
    n, k = 200, 256
    bound = 2 * workspace_bytes_per_tile(k) + 100
    route = QPN4BoundedRoute(workspace_bytes=bound)
    w = route.prepare(_weight(n, k))
    x = _x(50, k, dtype)
    for gated in (False, True):
        got = route.gate_up(x, w) if gated else route.linear(x, w)
        want = ref.qpn4_bounded_linear(x, w, bound, gated)
        assert _rel(got, want) <= TOLERANCE[dtype], f"gated={gated}"
    assert route.workspace_peak_bytes() == 2 * workspace_bytes_per_tile(k) <= bound


def test_fp16_inputs_use_the_prescaled_scales_and_fp32_inputs_the_raw_ones() -> None:
    """With the fp16 scales deliberately wrong (doubled), fp16 inputs must change by 2x and
    fp32 inputs not at all: each dtype reads the scale form it is documented to read."""
    route = QPN4BoundedRoute()
    w = route.prepare(_weight(64, 128))
    x = _x(40, 128)
    right16, right32 = route.linear(x.half(), w), route.linear(x, w)
    doubled = QPN4BoundedRoute()
    w2 = doubled.prepare(_weight(64, 128))
    w2._cache["fp16"] = w2.fp16_prescaled_or_none() * 2
    w2._cache.pop(doubled)  # rebuild the op arguments with the doubled scales
    assert torch.equal(doubled.linear(x.half(), w2), right16 * 2)
    assert torch.equal(doubled.linear(x, w2), right32)


def test_qpn2_is_bitwise_identical_across_thread_counts() -> None:
    w = QPN2.prepare(_weight(512, 1024))  # 16 tiles over the threads, 4 split-K slices
    x = _x(8, 1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = QPN2.linear(x, w)
        torch.set_num_threads(max(2, threads))
        many = QPN2.linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert_bitwise_equal(many, one, "qpn2, 1 thread vs several")
    assert_bitwise_equal(QPN2.linear(x, w), one, "qpn2 run to run")


def test_baseline_simd_copy_matches_the_reference() -> None:
    """Machines without AVX2 run the baseline copy; $DFLASH_QPN_DISABLE_AVX2 forces it here."""
    code = (
        "import torch\n"
        "from dflash_kernels.gemm import QPN2, QPN4_BOUNDED\n"
        "from dflash_kernels import qpn_reference as ref\n"
        "from dflash_kernels.nvfp4 import quantize\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w = quantize(torch.randn(96, 512, generator=g) * 0.05)\n"
        "x = torch.randn(5, 512, generator=g)\n"
        "a = QPN2.linear(x, QPN2.prepare(w)); b = ref.qpn2_linear(x, QPN2.prepare(w))\n"
        "c = QPN4_BOUNDED.linear(x, QPN4_BOUNDED.prepare(w))\n"
        "print(float((a - b).norm() / b.norm()), float((c - b).norm() / b.norm()))\n"
    )
    env = {**os.environ, "DFLASH_QPN_DISABLE_AVX2": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = [float(v) for v in done.stdout.split()]
    assert len(errors) == 2 and max(errors) <= 2e-6, done.stdout


def test_device_spellings_share_one_workspace_and_one_peak() -> None:
    """The peak is recorded under the device the tensors are on and read under the device the
    caller names: 'cpu' and 'cpu:0' (like 'cuda' and 'cuda:0') must be one key. Keyed by the
    raw torch.device, the second spelling read a fresh workspace with peak 0."""
    assert qpn_native.device_key("cpu:0") == qpn_native.device_key("cpu") == torch.device("cpu")
    assert shared_workspace("cpu:0") is shared_workspace("cpu")
    assert shared_workspace(torch.device("cpu", 0)) is shared_workspace(torch.device("cpu"))
    route = QPN2PackedRoute()
    w = route.prepare(_weight(96, 256))
    route.linear(_x(40, 256), w)  # large-M branch: the shared workspace is used
    peak = route.workspace_peak_bytes("cpu")
    assert peak > 0
    assert route.workspace_peak_bytes("cpu:0") == peak
    assert route.workspace_peak_bytes(torch.device("cpu", 0)) == peak
    own = QPN4BoundedRoute()
    own.linear(_x(40, 256), own.prepare(_weight(96, 256)))
    assert own.workspace("cpu:0") is own.workspace("cpu")
    assert own.workspace_peak_bytes("cpu:0") == own.workspace_peak_bytes("cpu") > 0


def test_device_key_fills_in_the_current_cuda_device() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: 'cuda' is normalised to the current device's index")
    assert qpn_native.device_key("cuda") == torch.device("cuda", torch.cuda.current_device())


def test_native_hit_counters_feed_the_hit_snapshots() -> None:
    w = QPN2.prepare(_weight(64, 128))
    hits.reset()
    assert not any(route.startswith("gemm.nvfp4.qpn") for route, _ in hits.snapshot())
    QPN2.linear(_x(70, 128), w)  # three 32-row passes
    QPN2_PACKED.linear(_x(3, 128), w)
    assert hits.snapshot() == {("gemm.nvfp4.qpn2", "small_m"): 4,
                               ("gemm.nvfp4.qpn2_packed", "small_m"): 1}
    with hits.counting() as delta:
        QPN2_PACKED.linear(_x(33, 128), w)
    assert delta.counts == {("gemm.nvfp4.qpn2_packed", "large_m"): 1,
                            ("gemm.nvfp4.qpn4_bounded", "large_m"): 1}


def test_workspace_storage_is_released_with_its_route() -> None:
    route = QPN4BoundedRoute()
    route.linear(_x(40, 128), route.prepare(_weight(64, 128)))
    ws_id = route.workspace("cpu").id
    assert int(torch.ops.dflash_qpn.workspace_peak(ws_id)) > 0
    del route
    gc.collect()
    assert int(torch.ops.dflash_qpn.workspace_peak(ws_id)) == 0  # a fresh, empty slot


_ARGUMENT_ERRORS = r"""
import json, re, torch
from dflash_kernels.gemm import QPN2, packed_plan, shared_workspace
from dflash_kernels.nvfp4 import quantize
g = torch.Generator().manual_seed(0)
w = QPN2.prepare(quantize(torch.randn(90, 128, generator=g) * 0.05))
x = torch.randn(2, 128, generator=g)
op, packed = torch.ops.dflash_qpn.qpn2_linear, torch.ops.dflash_qpn.qpn2_packed_linear
ws = shared_workspace("cpu").id
calls = {
    "flat uint8 QPN": lambda: op(x, w.buffer.int(), w.scales, w.global_scale, w.n, w.k, False),
    "raw E4M3 bytes": lambda: op(x, w.buffer, w.scales.view(-1), w.global_scale, w.n, w.k, False),
    "K = 128 but the weight": lambda: op(x, w.buffer, w.scales, w.global_scale, w.n, 192, False),
    "K % 64 == 0": lambda: op(x, w.buffer, w.scales, w.global_scale, w.n, 96, False),
    "n = 200 does not match": lambda: op(x, w.buffer, w.scales, w.global_scale, 200, w.k, False),
    "even N": lambda: op(x, w.buffer, w.scales, w.global_scale, 89, w.k, True),
    "fp32 or fp16": lambda: op(x.bfloat16(), w.buffer, w.scales, w.global_scale, w.n, w.k, False),
    r"2-D \[M, K\]": lambda: op(x[None], w.buffer, w.scales, w.global_scale, w.n, w.k, False),
    "scales_fp16 must be contiguous fp16": lambda: packed(
        x, w.buffer, w.scales, w.scales.float(), w.n,
        packed_plan(w.k, 33, ws, 2**20, w.global_scale), False),
    "raise workspace_bytes to at least": lambda: packed(
        torch.randn(40, 128), w.buffer, w.scales, None, w.n,
        packed_plan(w.k, 33, ws, 100, w.global_scale), False),
    "min_prefill_m > 8": lambda: packed(
        x, w.buffer, w.scales, None, w.n, packed_plan(w.k, 4, ws, 2**20, w.global_scale), False),
    "plan must be a contiguous CPU int64 tensor": lambda: packed(
        x, w.buffer, w.scales, None, w.n,
        packed_plan(w.k, 33, ws, 2**20, w.global_scale).int(),
        False),
}
out = {}
for match, call in calls.items():
    try:
        call()
        out[match] = None
    except Exception as exc:
        out[match] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
"""


def test_op_argument_errors_name_the_problem(run_child_json) -> None:
    """Each bad call raises ValueError naming the problem. In a child interpreter: on a CUDA
    build linked with a static libstdc++, a refused call crashed the process (docs/cuda.md)."""
    for match, raised in run_child_json(_ARGUMENT_ERRORS).items():
        assert raised is not None, f"no error for the case {match!r}"
        kind, message = raised
        assert kind == "ValueError" and re.search(match, message), (match, kind, message)


# ---------------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (the CUDA kernels of dflash_qpn)")
# fp16 inputs on CUDA: the large-M workspace holds fp16 values (one rounding per weight)
CUDA_TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3}


def _cuda_weight(n: int, k: int, seed: int = 0) -> NVFP4Weight:
    w = _weight(n, k, seed)
    return NVFP4Weight(w.packed.cuda(), w.scales.cuda(), w.global_scale, w.shape)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_kernels_match_the_reference(dtype) -> None:
    """qpn2 (WMMA for fp16, SIMT for fp32) and qpn4_bounded (fp16/fp32 workspace + cuBLAS)
    against the torch reference on the same device, every M around the block edges."""
    for n, k in ((90, 64), (200, 1024), (512, 320)):
        w = QPN2.prepare(_cuda_weight(n, k, seed=n))
        bound = 2 * workspace_bytes_per_tile(k) + 100
        route4 = QPN4BoundedRoute(workspace_bytes=bound)
        for m in (1, 3, 8, 9, 17, 32, 33, 70):
            x = _x(m, k, dtype, seed=m).cuda()
            for gated in (False, True):
                label = f"{n}x{k} M={m} gated={gated}"
                got = QPN2.gate_up(x, w) if gated else QPN2.linear(x, w)
                want = ref.qpn2_linear(x, w, gated)
                assert _rel(got, want) <= CUDA_TOLERANCE[dtype], f"qpn2 {label}"
                got = route4.gate_up(x, w) if gated else route4.linear(x, w)
                want = ref.qpn4_bounded_linear(x, w, bound, gated)
                assert _rel(got, want) <= CUDA_TOLERANCE[dtype], f"qpn4_bounded {label}"
        assert 0 < route4.workspace_peak_bytes("cuda") <= bound


def _cuda_kernel_names(fn) -> set[str]:
    """Names of the CUDA kernels one call of ``fn`` ran (CUPTI, through torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type.name == "CUDA"}


@needs_cuda
@pytest.mark.parametrize("body", ["mma", "simt"])
@pytest.mark.parametrize(
    ("n", "k", "depth"),
    [
        # 136 tiles of 260 groups: splits of several load batches in both register sets,
        # plus a short last split
        (4352, 4096 + 64, None),
        # 6145 tiles of 4 groups, the gated halves meeting in the middle of a tile
        (2 * 98320, 64, None),
        # 2048 tiles of 64 groups: one split per tile and block (up to ~200 SMs), so the
        # tensor-core body loads 8 groups per warp and batch
        (65536, 1024, 8),
    ],
    ids=["long-splits", "many-tiles", "deep-batches"],
)
def test_cuda_m1_kernel_matches_the_reference(body, n, k, depth, monkeypatch) -> None:
    """M = 1 has its own fp16 kernel (docs/qpn.md, "The M = 1 kernel") with two bodies: WMMA
    m16n16k16 fed straight from the lanes' registers where the device's fragment layout is the
    one it is written for (sm_80+, probed once per device), SIMT fp32 elsewhere or when
    $DFLASH_QPN_M1_SIMT asks for it; the tensor-core body loads 4 or 8 groups per warp and
    batch, by the layer's splits. Each shape, gated and not, is checked against the reference
    (also column by column) and rerun bitwise; the kernel that ran is read back from the
    profiler, so a probe or plan that silently fell back would fail."""
    if body == "simt":
        monkeypatch.setenv("DFLASH_QPN_M1_SIMT", "1")
    else:
        monkeypatch.delenv("DFLASH_QPN_M1_SIMT", raising=False)
        if torch.cuda.get_device_capability() < (8, 0):
            pytest.skip("the tensor-core M = 1 body needs the sm_80+ WMMA fragment layout")
    w = QPN2.prepare(_cuda_weight(n, k, seed=7))
    x = _x(1, k, torch.float16, seed=1).cuda()
    ran = _cuda_kernel_names(lambda: QPN2.linear(x, w))
    wanted = f"qpn2_row_kernel<{'true' if body == 'mma' else 'false'}, "
    if body == "mma" and depth is not None:
        wanted += f"{depth}>"
    assert any(wanted in name for name in ran), f"{wanted} did not run; ran: {sorted(ran)}"
    for gated in (False, True):
        got = QPN2.gate_up(x, w) if gated else QPN2.linear(x, w)
        want = ref.qpn2_linear(x, w, gated)
        assert _rel(got, want) <= CUDA_TOLERANCE[torch.float16], f"gated={gated}"
        # and column by column: a split summed twice or not at all moves a few columns
        # by about their own size, which the L2 norm over 10^5 columns could hide
        err = (got.double() - want.double()).abs()
        bound = 2.0**-9 * want.double().abs() + 1e-3 * want.double().pow(2).mean().sqrt()
        worst = int((err - bound).argmax())
        assert err[0, worst] <= bound[0, worst], (
            f"gated={gated}: column {worst} is {got[0, worst].item()}, "
            f"want {want[0, worst].item()}"
        )
        assert_bitwise_equal(QPN2.gate_up(x, w) if gated else QPN2.linear(x, w), got,
                             f"gated={gated} run to run")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_finite_e4m3_scale_decodes_exactly(device, dtype) -> None:
    """Each column of this weight has its own block scale, one per finite non-negative e4m3
    byte (normal, subnormal, zero; validation refuses negative scales): every decode of a
    scale (the branch-free bit placements of the M = 1, WMMA and fp32 kernels, the dequantize
    of the large-M path) must give the exact value, so each output is the exact dot product
    up to fp32 summation order (and one fp16 rounding of the output). Global scale 2^-10: the
    fp16 pre-scaled scales are exact too."""
    codes = torch.arange(0x7F, dtype=torch.uint8)  # 0x7F is NaN
    n, k = codes.numel(), 64  # K: the QPN contract's multiple of 64
    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = codes.view(torch.float8_e4m3fn).reshape(n, 1).repeat(1, k // 16)
    raw = NVFP4Weight(packed, scales, 2.0**-10, (n, k))
    w = QPN2.prepare(NVFP4Weight(packed.to(device), scales.to(device), 2.0**-10, (n, k)))
    dense = dequantize(raw, torch.float64)
    for m, route in ((1, QPN2), (2, QPN2), (40, QPN4BoundedRoute())):
        x = _x(m, k, dtype, seed=m)
        exact = x.double() @ dense.T
        bound = 1e-6 * (x.double().abs() @ dense.abs().T)
        if dtype == torch.float16:
            bound += 2.0**-11 * exact.abs() + 2.0**-24
        got = route.linear(x.to(device), w).cpu().double()
        worst = ((got - exact).abs() - bound).max().item()
        assert worst <= 0, f"{route.name} M={m}: an output is off its exact value by {worst:g}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_small_m_reads_an_unaligned_x_view(device, dtype) -> None:
    """x may be a view that starts at any element (here: one element into its storage); the
    small-M kernels read x in vectors (up to 16 bytes on CUDA), so such an x must give the same
    bits as an aligned copy, not a misaligned-address fault that ends the CUDA context."""
    k = 512
    w = _weight(96, k, seed=3)
    w = QPN2.prepare(NVFP4Weight(w.packed.to(device), w.scales.to(device), w.global_scale,
                                 w.shape))
    for m in (1, 2, 9):
        x = _x(m, k, dtype, seed=m).to(device)
        view = torch.empty(m * k + 1, dtype=dtype, device=device)[1:].view(m, k)
        view.copy_(x)
        assert view.data_ptr() % 16 != 0
        for gated in (False, True):
            run = QPN2.gate_up if gated else QPN2.linear
            assert_bitwise_equal(run(view, w), run(x, w), f"M={m} gated={gated}")


@needs_cuda
def test_cuda_packed_is_deterministic_and_bitwise_its_partners() -> None:
    w = QPN2_PACKED.prepare(_cuda_weight(1024, 2048))
    qpn4 = QPN4BoundedRoute()
    for m in (1, 8, 40):
        x = _x(m, 2048, torch.float16, seed=m).cuda()
        partner = QPN2 if m < QPN2_PACKED.min_prefill_m else qpn4
        first = QPN2_PACKED.linear(x, w)
        assert_bitwise_equal(QPN2_PACKED.linear(x, w), first, f"M={m} run to run")
        assert_bitwise_equal(partner.linear(x, w), first, f"M={m} vs {partner.name}")


@needs_cuda
def test_cuda_workspace_peak_is_found_under_cuda_and_cuda_0() -> None:
    """The bug this fixes: the peak was recorded under 'cuda:0' (the tensors' device) and read
    under 'cuda' (the gate's --dflash-device), which found an empty workspace: peak 0."""
    route = QPN2PackedRoute()
    route.linear(_x(40, 256, torch.float16).cuda(), route.prepare(_cuda_weight(96, 256)))
    index = torch.cuda.current_device()
    peak = route.workspace_peak_bytes("cuda")
    assert peak > 0
    assert route.workspace_peak_bytes(f"cuda:{index}") == peak
    assert shared_workspace("cuda") is shared_workspace(torch.device("cuda", index))
