"""qpn2_packed's verify step against qpn2's, at every verify width, for a fixed number of rounds.

    python benchmarks/verify_step_ratio.py [--rounds 384] [--profile ci] [--device cpu|cuda]

The op-level validation_cost gate stops as soon as its CI decides, so its figures say little
about how the two routes compare when it does not. This times the very steps the gate times
(gate/up then down on the one resident weight copy both routes share, the gate's
``cpu_sample_min_s`` repetition, seeded random order per round) for exactly ``--rounds`` rounds
per width and prints, per M:

- the median candidate/baseline ratio and its bootstrap CI at the policy's confidence;
- the step's median time and the calls per sample;
- the order shift: half the difference of the mean log-ratio between rounds where the
  candidate ran first and rounds where it ran second, in percent (a position effect inside a
  round, e.g. the second call finding warmer caches, shows as a shift of one sign).

Run it in several processes, and under each interpreter you gate with: docs/benchmarks.md shows
the process-to-process and interpreter-to-interpreter spread it found.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from dflash_kernels import qpn_native
from dflash_kernels.gemm import QPN2, QPN2_PACKED
from dflash_suites.support.gemm import layer_shape, make_weight, make_x
from pytest_dflash.measure.round_statistics import paired_compare
from pytest_dflash.measure.timing import calls_per_sample, round_timer
from pytest_dflash.policy.thresholds import Policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=384)
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    qpn_native.require(device)
    policy = Policy()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    k_gu, n_gu = layer_shape("gate_up", args.profile)
    k_down, n_down = layer_shape("down", args.profile)
    gate_up = QPN2.prepare(make_weight(n_gu, k_gu, seed=1, device=device))
    down = QPN2.prepare(make_weight(n_down, k_down, seed=2, device=device))
    print(f"pid {os.getpid()}, {args.rounds} rounds per width, {device}")
    for m in range(1, policy.validation_max_m + 1):
        x = make_x(m, k_gu, seed=2 + m, dtype=dtype, device=device)

        def on(x: torch.Tensor = x) -> torch.Tensor:
            return QPN2_PACKED.linear(QPN2_PACKED.gate_up(x, gate_up), down)

        def off(x: torch.Tensor = x) -> torch.Tensor:
            return QPN2.linear(QPN2.gate_up(x, gate_up), down)

        calls = calls_per_sample(off, device, policy.cpu_sample_min_s)

        result = paired_compare(round_timer(on, off, device=device, calls=calls),
                                rounds=args.rounds,
                                max_rounds=args.rounds, confidence=policy.speed_confidence,
                                resamples=policy.bootstrap_resamples, seed=policy.seed + m,
                                rule="no_regression", threshold=1 + policy.validation_noise_floor,
                                warmup=policy.speed_warmup)
        log_ratio = np.log(np.asarray(result.ratios))
        orders = np.asarray(result.orders)
        shift = (log_ratio[orders == "cb"].mean() - log_ratio[orders == "bc"].mean()) / 2 * 100
        step_us = float(np.median(result.baseline_s)) * 1e6
        print(f"M={m}: {result.median:.4f} [{result.ci_low:.4f}, {result.ci_high:.4f}], step "
              f"{step_us:.0f} us x {calls} per sample, order shift {shift:+.2f}%", flush=True)


if __name__ == "__main__":
    main()
