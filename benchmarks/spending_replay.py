"""Replay the timing protocol's sequential design on recorded process statistics.

How many processes would a main job time, and how often would each timing result pass, if the
looks were laid out differently (first look, process cap) or the error rate split differently
between the interim looks and the last one? Each recorded timing result's processes (pooled by
gate over the given reports) are resampled with replacement, and the gate's own
``process_compare`` decides on them, 200 times per design. A process's seconds (building and
warming the pair, and its timed rounds) times the processes the policy's design takes is what
the gate is expected to cost, so reports measured with another round count per process
(``timing_min_rounds_per_process``) compare that too. The split is the share of the error
rate the interim looks get (the gates give them a tenth, ``INTERIM_SHARE``; ``2/3`` over
three looks is an equal split). Writes a ``pytest-dflash/benchmark/1`` file for
``benchmarks/render.py``:

    python benchmarks/spending_replay.py run1.json run2.json run3.json \\
        --out benchmarks/results/spending-replay.json --machine "..." --commit "..." \\
        --command "..." --about "..."
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np
from futility_replay import (  # this directory, as a script's, is on sys.path
    replay_arguments,
    timing_results,
    write_replay,
)

from pytest_dflash.evidence import compact
from pytest_dflash.measure.decision import INTERIM_SHARE
from pytest_dflash.measure.process_statistics import ProcessSample, process_compare
from pytest_dflash.policy.thresholds import Policy

# (first look, process cap, interim share): the policy's design first; (6, 6) is one look at
# the nominal confidence, the quick and ci profiles' design (ProfileSizes.timing_looks)
DESIGNS: tuple[tuple[int, int, float], ...] = (
    (6, 18, INTERIM_SHARE), (6, 18, 0.3), (6, 18, 2 / 3), (8, 16, INTERIM_SHARE),
    (4, 16, INTERIM_SHARE), (6, 12, INTERIM_SHARE), (6, 6, INTERIM_SHARE))
RESAMPLES = 200


def replay(stats: np.ndarray, rule: str, threshold: float, design: tuple[int, int, float],
           policy: Policy, seed: int) -> tuple[int, str]:
    """(processes timed, decision) of one resampled run of ``design``."""
    first, cap, share = design
    rng = np.random.default_rng(seed)

    def sample(count: int, rounds: int) -> list[ProcessSample]:
        del rounds  # a recorded statistic stands for the whole process: two rounds of that
        # ratio, the fewest a process's own variance (variance_components) is defined for
        return [ProcessSample(worker=0, pid=0, candidate_s=[math.exp(s)] * 2,
                              baseline_s=[1.0, 1.0], orders=["cb", "bc"])
                for s in rng.choice(stats, count)]

    result = process_compare(
        sample, processes=first, max_processes=cap, rounds=policy.timing_min_rounds_per_process,
        confidence=policy.speed_confidence, rule=rule, threshold=threshold,
        max_rounds=policy.timing_max_rounds_per_process, futility=policy.timing_futility,
        interim_share=share)
    return len(result.processes), result.decision


def main(argv: list[str] | None = None) -> int:
    args = replay_arguments(__doc__, argv)
    policy = Policy()
    pooled: dict[str, dict[str, Any]] = {}
    fingerprint: dict[str, Any] = {}
    for path in args.reports:
        report = json.loads(path.read_text(encoding="utf-8"))
        fingerprint = fingerprint or report["fingerprint"]
        for route, what, item in timing_results(report):
            entry = pooled.setdefault(f"{route} {what}", {
                "rule": item["rule"], "threshold": item["threshold"], "stats": [], "seconds": [],
                "rounds": set()})
            for process in item["processes"]:
                entry["stats"].append(process["statistic"])
                # what the process cost the gate: building and warming the pair, and its rounds
                entry["seconds"].append(process["setup_s"] + compact.timed_seconds(process))
                entry["rounds"].add(process["rounds"])
    rows, totals, passes = [], [0.0] * len(DESIGNS), [0] * len(DESIGNS)
    seconds_total = 0.0
    for what, entry in sorted(pooled.items()):
        stats = np.asarray(entry["stats"])
        cells, means = [], []
        for i, design in enumerate(DESIGNS):
            runs = [replay(stats, entry["rule"], entry["threshold"], design, policy, seed)
                    for seed in range(RESAMPLES)]
            mean = sum(n for n, _ in runs) / RESAMPLES
            passed = sum(d == "pass" for _, d in runs)
            means.append(mean)
            totals[i] += mean
            passes[i] += passed
            cells.append(f"{mean:.1f} / {passed / RESAMPLES:.1%}")
        per_process = float(np.mean(entry["seconds"]))
        expected = per_process * means[0]  # the policy's design
        seconds_total += expected
        fewest, most = min(entry["rounds"]), max(entry["rounds"])
        rounds = str(fewest) if fewest == most else f"{fewest} to {most}"
        rows.append([what, str(stats.size), rounds, f"{per_process:.2f}", f"{expected:.1f}",
                     *cells])
    runs_all = RESAMPLES * len(pooled)
    rows.append(["all results (summed)", "-", "-", "-", f"{seconds_total:.1f}",
                 *(f"{t:.1f} / {p / runs_all:.1%}" for t, p in zip(totals, passes, strict=True))])
    columns = ["timing result", "recorded processes", "rounds a process", "seconds a process",
               "expected seconds (policy's design)",
               *(f"looks of {a} to {b}, interim share {s:.2f}: processes / pass"
                 for a, b, s in DESIGNS)]
    write_replay(args, fingerprint,
                 title=f"Sequential designs replayed on {len(pooled)} recorded timing results "
                       f"({len(args.reports)} runs, {RESAMPLES} resampled runs each)",
                 columns=columns, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
