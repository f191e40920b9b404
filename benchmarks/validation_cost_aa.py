"""A/A check of the op-level validation_cost rule: qpn2 timed against itself.

    python benchmarks/validation_cost_aa.py [--device cpu|cuda] [--profile ci|full]
                                            [--cpu-sample-min-s SECONDS]

Both sides are the very same verify step (gate/up then down through qpn2, on one prepared copy
of the weights), timed by ``pytest_dflash.measure.timing.speed_gate`` with the no_regression rule,
the
default policy and M = 1..8, exactly as the gate times a candidate. A null change must pass at
every width; a width that fails measures how often the host's own noise would reject a
candidate that changes nothing. ``--cpu-sample-min-s 0`` times one call per sample (the
protocol before ``cpu_sample_min_s``) to compare.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from dflash_kernels import qpn_native
from dflash_kernels.gemm import QPN2
from dflash_suites.support.gemm import layer_shape, make_weight, make_x
from pytest_dflash.measure.timing import speed_gate
from pytest_dflash.policy.thresholds import Policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--cpu-sample-min-s", type=float, default=Policy().cpu_sample_min_s)
    args = parser.parse_args()
    device = torch.device(args.device)
    qpn_native.require(device)
    policy = dataclasses.replace(Policy(), cpu_sample_min_s=args.cpu_sample_min_s)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    k_gu, n_gu = layer_shape("gate_up", args.profile)
    k_down, n_down = layer_shape("down", args.profile)
    gate_up = QPN2.prepare(make_weight(n_gu, k_gu, seed=1, device=device))
    down = QPN2.prepare(make_weight(n_down, k_down, seed=2, device=device))
    failed = 0
    for m in range(1, policy.validation_max_m + 1):
        x = make_x(m, k_gu, seed=2 + m, dtype=dtype, device=device)

        def step(x: torch.Tensor = x) -> torch.Tensor:
            return QPN2.linear(QPN2.gate_up(x, gate_up), down)

        record: dict = {}
        try:
            speed_gate(step, step, policy=policy, device=device, record=record.update,
                       label=f"A/A verify M={m}", rule="no_regression")
        except AssertionError:
            failed += 1
        print(f"M={m}: {record['figure']} ({record['outcome']}, "
              f"{record['calls_per_sample']} calls per sample)", flush=True)
    print(f"A/A on {device}: {failed} of {policy.validation_max_m} widths failed "
          f"(cpu_sample_min_s = {policy.cpu_sample_min_s})")


if __name__ == "__main__":
    main()
