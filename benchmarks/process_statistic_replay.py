"""Replay a process's statistic on the rounds recorded in reports: median against the
interquartile mean, on all of a process's rounds and on the first part of them.

A timing gate decides on the spread of its per-process statistics across processes, so the
statistic that is the same process's rounds' best summary is the one whose spread across
processes is smallest at the same budget. For every cross-process timing result whose
processes timed at least ``MIN_ROUNDS`` rounds, this computes the spread (sd across processes,
in log ratio) of the median of the rounds and of their interquartile mean
(``process_statistics.process_statistic``), on all recorded rounds and on each process's
first ``FRACTIONS`` of them (what a shorter budget would have timed), and writes a
``pytest-dflash/benchmark/1`` file for ``benchmarks/render.py``:

    python benchmarks/process_statistic_replay.py run1.json run2.json \\
        --out benchmarks/results/cpu-process-statistic.json --machine "..." --commit "..." \\
        --command "..." --about "..."
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from futility_replay import (  # this directory, as a script's, is on sys.path
    replay_arguments,
    timing_results,
    write_replay,
)

from pytest_dflash.evidence import compact
from pytest_dflash.measure.process_statistics import process_statistic

MIN_ROUNDS = 40  # below it the first part of a process's rounds is too few to compare
FRACTIONS = (0.6, 0.5)


def spreads(item: dict[str, Any]) -> dict[str, float]:
    """sd across processes of each statistic, keyed ``"median@1.0"``, ``"iqm@0.6"`` ..."""
    logs = [np.log(np.asarray(cand) / np.asarray(base))
            for cand, base, _ in map(compact.every_round, item["processes"])]
    out: dict[str, float] = {}
    for fraction in (1.0, *FRACTIONS):
        parts = [x[: max(4, int(fraction * x.size))] for x in logs]
        out[f"median@{fraction}"] = float(np.std([np.median(x) for x in parts], ddof=1))
        out[f"iqm@{fraction}"] = float(np.std([process_statistic(np.exp(x)) for x in parts],
                                              ddof=1))
    return out


def main(argv: list[str] | None = None) -> int:
    args = replay_arguments(__doc__, argv)
    rows: list[list[str]] = []
    fingerprint: dict[str, Any] = {}
    ratios: list[float] = []
    for path in args.reports:
        report = json.loads(path.read_text(encoding="utf-8"))
        fingerprint = fingerprint or report["fingerprint"]  # the first report's environment
        for route, what, item in timing_results(report):
            rounds = [len(compact.every_round(p)[0]) for p in item["processes"]]
            if min(rounds) < MIN_ROUNDS or len(rounds) < 3:
                continue
            sd = spreads(item)
            ratios.append(sd["iqm@1.0"] / sd["median@1.0"])
            rows.append([path.name, route, what, f"{len(rounds)} x {min(rounds)}-{max(rounds)}",
                         *(f"{100 * sd[key]:.2f}" for key in
                           ("median@1.0", "iqm@1.0", *(f"iqm@{f}" for f in FRACTIONS),
                            *(f"median@{f}" for f in FRACTIONS)))])
    write_replay(args, fingerprint,
                 title=f"A process's statistic replayed on {len(rows)} recorded timing results: "
                       f"the interquartile mean's spread across processes is "
                       f"{np.median(ratios):.2f} x the median's (median over results)",
                 columns=["report", "route", "timing result", "processes x rounds",
                          "sd median, all rounds (%)", "sd interquartile mean, all rounds (%)",
                          *(f"sd interquartile mean, first {int(100 * f)}% (%)"
                            for f in FRACTIONS),
                          *(f"sd median, first {int(100 * f)}% (%)" for f in FRACTIONS)],
                 rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
