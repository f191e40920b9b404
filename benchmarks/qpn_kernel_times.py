"""Kernel-level GPU times of the QPN routes against fp16 cuBLAS, on the target's layer shapes.

    python benchmarks/qpn_kernel_times.py [M ...]        # default M = 1 8 3296; needs CUDA

Per route and M it prints three figures, because at these sizes (5 to 500 us) they differ:

- ``events``: one call timed with CUDA events after an L2 flush (``pytest_dflash.measure.timing.
  cuda_timer``, what the gates and ``test_bench_qpn.py`` measure), median of 25;
- ``queued``: the same with the GPU kept busy (``cuda_timer(..., spin_cycles=)``, a ~100 us spin
  kernel) while the host enqueues the call, so host-side dispatch cost cannot show; equal to
  ``events`` when the call is GPU-bound;
- the per-kernel device times from CUPTI (``torch.profiler``), averaged over 10 calls: what the
  bandwidth floor compares to, free of the event and launch overhead (5 to 10 us per call on an
  H200).

Per layer it first prints a plain read: the CUPTI time of one ``torch.sum`` over as many bytes as
the weight's codes and scales, averaged over 10 calls like the kernel sums (no L2 flush between
them, the same for both). The nominal floor (those bytes at the HBM peak) is not reachable at
these sizes; the plain read shows what a library kernel that only streams them takes.
"""

from __future__ import annotations

import functools
import statistics
import sys
import zlib
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_kernels.gemm import QPN2, QPN4_BOUNDED
from dflash_kernels.nvfp4 import NVFP4Weight, dequantize, quantize
from dflash_suites.support.gemm import layer_shape
from pytest_dflash.measure.timing import cuda_timer

DEVICE = torch.device("cuda")
ROUNDS = 25
SPIN_CYCLES = 200_000  # about 100 us of GPU spin: longer than the host takes to enqueue a call


def weight(layer: str) -> NVFP4Weight:
    k, n = layer_shape(layer, "full")
    gen = torch.Generator().manual_seed(zlib.crc32(layer.encode()))
    w = quantize(torch.randn(n, k, generator=gen) * 0.05)
    return NVFP4Weight(w.packed.to(DEVICE), w.scales.to(DEVICE), w.global_scale, w.shape)


def kernel_us(fn: Callable[[], object], calls: int = 10) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            per_kernel[kernel_name(event.name)] += event.device_time_total / calls
    return dict(per_kernel)


def kernel_name(name: str) -> str:
    """A kernel's name without return type, namespaces and arguments, at most 60 characters,
    so that its template arguments (which body, how deep a load batch) stay readable:
    ``void dflash_qpn::(anonymous namespace)::qpn2_row_kernel<true, 8>(...)`` reads
    ``qpn2_row_kernel<true, 8>``; names that are not signatures (``Memset (Device)``) stay."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    head, paren, _ = name.partition("(")
    if paren and not head.endswith(" "):
        name = head
    return name.removeprefix("dflash_qpn::")[:60]


def plain_read(w: NVFP4Weight) -> tuple[float, int]:
    """CUPTI time (us) of one ``torch.sum`` over the weight's byte count, and that count."""
    nbytes = w.packed.numel() + w.scales.numel()
    blob = torch.zeros(nbytes // 4, device=DEVICE, dtype=torch.float32)
    for _ in range(5):
        blob.sum()
    return sum(kernel_us(blob.sum).values()), nbytes


def main(ms: list[int]) -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device (torch sees none)")
    for layer in ("gate_up", "down"):
        w = weight(layer)
        qpn2, qpn4 = QPN2.prepare(w), QPN4_BOUNDED.prepare(w)
        dense = dequantize(w, torch.float16)
        read_us, nbytes = plain_read(w)
        rate = nbytes / read_us / 1e6
        print(f"{layer} plain read: torch.sum over {nbytes / 1e6:.1f} MB, kernels "
              f"{read_us:.1f} us ({rate:.2f} TB/s)", flush=True)
        for m in ms:
            x = torch.randn(m, w.k, device=DEVICE, dtype=torch.float16)
            cases = {"fp16 cuBLAS": functools.partial(torch.matmul, x, dense.T)}
            if m <= 32:
                cases["qpn2"] = functools.partial(QPN2.linear, x, qpn2)
            else:
                cases["qpn4_bounded"] = functools.partial(QPN4_BOUNDED.linear, x, qpn4)
            for name, fn in cases.items():
                for _ in range(5):
                    fn()
                events = statistics.median(cuda_timer(fn, DEVICE) * 1e6 for _ in range(ROUNDS))
                queued = statistics.median(cuda_timer(fn, DEVICE, spin_cycles=SPIN_CYCLES) * 1e6
                                           for _ in range(ROUNDS))
                kernels = kernel_us(fn)
                detail = "; ".join(f"{k}: {v:.1f}" for k, v in kernels.items())
                print(f"{layer} M={m} {name}: events {events:.1f} us, queued "
                      f"{queued:.1f} us, kernels {sum(kernels.values()):.1f} us "
                      f"({detail})", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8, 3296])
