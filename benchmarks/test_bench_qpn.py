"""Benchmarks of the native QPN kernels (pytest-benchmark), run by hand, not in CI:

    pytest benchmarks/test_bench_qpn.py --benchmark-json bench.json

On CUDA (target deployment shapes): every sample is one call timed with CUDA events after an L2
flush (:func:`pytest_dflash.measure.timing.cuda_timer`); the GPU-time median, p10 and p90 are
stored in
``extra_info`` (pytest-benchmark's own columns are the host time of flush + call + sync). On the
CPU (the ci profile's shapes) pytest-benchmark's own timing is the figure.

Compared, per layer (fused gate/up K=5120 N=8704, down K=4352 N=5120 on CUDA):
- qpn2 at M = 1..8 against the NVFP4 bandwidth floor (codes + scales bytes / peak DRAM bandwidth,
  from ``$DFLASH_BENCH_DRAM_TBPS``, default 4.8 for an H200) and against fp16 cuBLAS at M = 8;
- qpn4_bounded at the prefill chunk M = 3296 against fp16 cuBLAS of the same shape and against
  the turbomind baseline (dequantize + GEMM). Each kernel's output is checked against the fp64
  oracle before it is timed: a fast wrong kernel is not a result.
"""

from __future__ import annotations

import os
import statistics
import zlib

import pytest
import torch

from dflash_kernels.gemm import ORACLE, QPN2, QPN4_BOUNDED, TURBOMIND
from dflash_kernels.nvfp4 import NVFP4Weight, dequantize, quantize
from dflash_suites.support.gemm import TARGET_M, layer_shape
from pytest_dflash.measure.numerics import check_parity
from pytest_dflash.measure.timing import cuda_timer
from pytest_dflash.policy.thresholds import Policy

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROFILE = "full" if DEVICE.type == "cuda" else "ci"
DTYPE = torch.float16 if DEVICE.type == "cuda" else torch.float32
LARGE_M = TARGET_M if DEVICE.type == "cuda" else TARGET_M // 8
LAYERS = ("gate_up", "down")
ROUNDS = 50 if DEVICE.type == "cuda" else 20
DRAM_TBPS = float(os.environ.get("DFLASH_BENCH_DRAM_TBPS", "4.8"))

_weights: dict[str, NVFP4Weight] = {}


def _weight(layer: str) -> NVFP4Weight:
    if layer not in _weights:
        k, n = layer_shape(layer, PROFILE)
        gen = torch.Generator().manual_seed(zlib.crc32(layer.encode()))
        w = quantize(torch.randn(n, k, generator=gen) * 0.05)
        _weights[layer] = NVFP4Weight(w.packed.to(DEVICE), w.scales.to(DEVICE), w.global_scale,
                                      w.shape)
    return _weights[layer]


def _x(m: int, k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(m)
    return torch.randn(m, k, generator=gen).to(device=DEVICE, dtype=DTYPE)


def _check(out: torch.Tensor, x: torch.Tensor, w: NVFP4Weight, label: str) -> None:
    result = check_parity(out, ORACLE.linear(x.double(), w), TURBOMIND.linear(x, w),
                          policy=Policy(), dtype=x.dtype, label=label)
    assert result.ok, result.message()


def _run(benchmark, fn, label: str, **info) -> None:
    """Time ``fn``: CUDA events after an L2 flush per sample on CUDA, host time on the CPU."""
    benchmark.group = label
    benchmark.extra_info.update(device=str(DEVICE), dtype=str(DTYPE), **info)
    if DEVICE.type != "cuda":
        benchmark.pedantic(fn, rounds=ROUNDS, iterations=1, warmup_rounds=3)
        return
    gpu: list[float] = []
    benchmark.pedantic(lambda: gpu.append(cuda_timer(fn, DEVICE)), rounds=ROUNDS, iterations=1,
                       warmup_rounds=5)
    gpu = sorted(gpu[5:] if len(gpu) > ROUNDS else gpu)
    benchmark.extra_info.update(
        gpu_median_us=statistics.median(gpu) * 1e6,
        gpu_p10_us=gpu[len(gpu) // 10] * 1e6,
        gpu_p90_us=gpu[(9 * len(gpu)) // 10] * 1e6,
    )
    print(f"\n{label}: GPU median {statistics.median(gpu) * 1e6:.1f} us {info}")


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("layer", LAYERS)
def test_qpn2_small_m(benchmark, layer, m) -> None:
    w = _weight(layer)
    prepared = QPN2.prepare(w)
    x = _x(m, w.k)
    _check(QPN2.linear(x, prepared), x, w, f"qpn2 {layer} M={m}")
    floor_bytes = prepared.buffer.numel() + prepared.scales.numel()
    _run(benchmark, lambda: QPN2.linear(x, prepared), f"qpn2 {layer} M={m}", route="qpn2",
         m=m, k=w.k, n=w.n, floor_us=floor_bytes / (DRAM_TBPS * 1e12) * 1e6,
         floor_bytes=floor_bytes)


@pytest.mark.parametrize("m", [8, LARGE_M])
@pytest.mark.parametrize("layer", LAYERS)
def test_dense_fp16_gemm(benchmark, layer, m) -> None:
    """The vendor GEMM on an already dequantized weight (fp16 cuBLAS on CUDA, fp32 on CPU)."""
    w = _weight(layer)
    dense = dequantize(w, DTYPE)
    x = _x(m, w.k)
    _run(benchmark, lambda: x @ dense.T, f"dense {layer} M={m}", route="dense", m=m, k=w.k,
         n=w.n)


@pytest.mark.parametrize("layer", LAYERS)
def test_qpn4_bounded_large_m(benchmark, layer) -> None:
    w = _weight(layer)
    prepared = QPN4_BOUNDED.prepare(w)
    x = _x(LARGE_M, w.k)
    _check(QPN4_BOUNDED.linear(x, prepared), x, w, f"qpn4_bounded {layer}")
    _run(benchmark, lambda: QPN4_BOUNDED.linear(x, prepared), f"qpn4_bounded {layer} M={LARGE_M}",
         route="qpn4_bounded", m=LARGE_M, k=w.k, n=w.n,
         workspace_peak_bytes=QPN4_BOUNDED.workspace_peak_bytes(DEVICE))


@pytest.mark.parametrize("m", [8, LARGE_M])
@pytest.mark.parametrize("layer", LAYERS)
def test_turbomind(benchmark, layer, m) -> None:
    w = _weight(layer)
    x = _x(m, w.k)
    _run(benchmark, lambda: TURBOMIND.linear(x, w), f"turbomind {layer} M={m}",
         route="turbomind", m=m, k=w.k, n=w.n)
