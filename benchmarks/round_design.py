"""How a CPU round is laid out, and what it does to the spread of identical code's ratio.

    python benchmarks/round_design.py [--processes 12] [--widths 1 8] [--budget 0.25]
                                      [--layouts block alternate]
                                      [--out benchmarks/results/cpu-round-design.json]

The op-level validation_cost gate's verify step (qpn2_packed against qpn2: the very same native
kernel, so the true ratio is 1) is timed in fresh processes, each for ``--budget`` seconds of
rounds after a warm-up, the calls per round sized as the gate sizes them
(``timing.calls_per_sample``). Two layouts of a round:

- ``block``: the gate's ``timing.round_timer``, k calls of one side timed as one sample, then
  k calls of the other;
- ``alternate``: the sides alternating call by call, each call timed alone, the side that goes
  first swapping from one pair of calls to the next (measured, not kept).

Per layout and width it reports the spread of the per-round log ratio (the median over
processes of each process's standard deviation) and the spread of the per-process statistic
(the median log ratio, what the gate's interval across processes is computed from): the latter
decides how many processes an identical copy needs before its interval fits inside the 1%
noise floor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def child(m: int, design: str, budget: float) -> dict[str, float]:
    """One process: warm up, then time rounds of ``design`` at width ``m`` for ``budget`` s."""
    import torch

    from dflash_suites.support.gemm import VerifySteps
    from pytest_dflash.measure.timing import calls_per_sample, cpu_timer, round_timer
    from pytest_dflash.policy.thresholds import Policy
    from pytest_dflash.routes import shipped
    from pytest_dflash.routes.registry import RouteRegistry

    registry = RouteRegistry()
    shipped.pytest_dflash_routes(registry)
    policy = Policy()
    steps = VerifySteps("gemm.nvfp4.qpn2_packed",
                        registry.get("gemm.nvfp4.qpn2_packed").implementation(),
                        registry.get("gemm.nvfp4.qpn2").implementation(), policy=policy,
                        profile="ci", device=torch.device("cpu"))
    cand, base = steps.steps(m)
    calls = calls_per_sample(base, "cpu", policy.cpu_sample_min_s)
    block = round_timer(cand, base, device="cpu", calls=calls)

    def alternate(order: str) -> tuple[float, float]:
        sides, spent = {"c": cand, "b": base}, {"c": 0.0, "b": 0.0}
        for i in range(calls):
            for side in order if i % 2 == 0 else order[::-1]:
                spent[side] += cpu_timer(sides[side])
        return spent["c"] / calls, spent["b"] / calls

    run_round = alternate if design == "alternate" else block
    for _ in range(policy.speed_warmup):
        run_round("cb")
    rng = np.random.default_rng()
    logs = []
    end = time.perf_counter() + budget
    while time.perf_counter() < end:
        c, b = run_round("cb" if rng.random() < 0.5 else "bc")
        logs.append(np.log(c / b))
    data = np.asarray(logs)
    return {"calls": calls, "rounds": int(data.size), "statistic": float(np.median(data)),
            "round_sd": float(data.std(ddof=1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=12)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--layouts", nargs="+", default=["block", "alternate"],
                        choices=["block", "alternate"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=2, metavar=("M", "DESIGN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1], args.budget)))
        return
    rows = []
    for m in args.widths:
        for design in args.layouts:
            runs = []
            for _ in range(args.processes):  # one after another: never two timing processes
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(m), design,
                     "--budget", str(args.budget)],
                    capture_output=True, text=True, check=True, cwd=ROOT)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            stats = np.asarray([r["statistic"] for r in runs])
            row = [design, args.budget, m, len(runs), int(np.median([r["calls"] for r in runs])),
                   int(np.median([r["rounds"] for r in runs])),
                   f"{np.median([r['round_sd'] for r in runs]):.3f}",
                   f"{stats.std(ddof=1):.4f}", f"{np.exp(stats.mean()):.4f}"]
            print(row, flush=True)
            rows.append(row)
    if args.out:
        import torch

        result = {
            "schema": "pytest-dflash/benchmark/1", "kind": "measured",
            "topic": "validation_cost on the CPU",
            "title": "Layout of a CPU round: block samples against calls alternated side by side",
            "about": ("qpn2_packed's verify step against qpn2's (the same kernel), each "
                      "process timing rounds for a quarter second as the gate does; the "
                      "spread of the per-process statistic is what the interval across "
                      "processes is computed from."),
            "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
            "python": platform.python_version(), "torch": torch.__version__, "cuda": None,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                     capture_output=True, text=True).stdout.strip(),
            "date": date.today().isoformat(),
            "command": "python benchmarks/round_design.py --out "
                       "benchmarks/results/cpu-round-design.json",
            "values": {"columns": ["layout", "budget (s)", "M", "processes", "calls per side",
                                   "rounds (median)", "per-round sd of log ratio",
                                   "sd of the per-process statistic",
                                   "geometric-mean ratio"], "rows": rows},
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
