"""Host cost of one M = 1 call: qpn2 against qpn2_packed, at the op and through the routes.

    python benchmarks/qpn_dispatch_cost.py [--reps 5000] [--repeats 21]

A verify step reaches the same qpn2 kernel through either op, so what the validation_cost gate
can see between them is the call itself: arguments crossing ``torch.ops``, the op's checks and
its branch. On a 32 x 64 weight the kernel is negligible and the call is what is timed. Prints
the median over ``--repeats`` blocks of ``--reps`` calls each, in microseconds per call; the
four kinds of call are interleaved block by block.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dflash_kernels import qpn_native
from dflash_kernels.gemm import QPN2, QPN2_PACKED
from dflash_kernels.nvfp4 import quantize


def _per_call_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter_ns()
    for _ in range(reps):
        fn()
    return (time.perf_counter_ns() - start) / reps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    qpn_native.require(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(32, 64, generator=gen) * 0.05)
    a, b = QPN2.prepare(w), QPN2_PACKED.prepare(w)
    x = torch.randn(1, 64, generator=gen)
    QPN2.linear(x, a)  # the first call of each route builds its op arguments once
    QPN2_PACKED.linear(x, b)
    op2 = torch.ops.dflash_qpn.qpn2_linear.default
    op_packed = torch.ops.dflash_qpn.qpn2_packed_linear.default
    args2, args_packed = a._cache[QPN2], b._cache[QPN2_PACKED]
    calls = {
        "op qpn2_linear": lambda: op2(x, *args2, False),
        "op qpn2_packed_linear": lambda: op_packed(x, *args_packed, False),
        "route qpn2": lambda: QPN2.linear(x, a),
        "route qpn2_packed": lambda: QPN2_PACKED.linear(x, b),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, fn in calls.items():
            times[name].append(_per_call_us(fn, args.reps))
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.2f} us per call")


if __name__ == "__main__":
    main()
