"""Replay the futility stop (policy ``timing_futility``) on the processes recorded in reports.

A report keeps every timing test's per-process statistics in the order the looks took them.
This reruns each interim look's futility check on them and counts the results it would have
stopped early and the decisions it would have changed (a stop only ever makes a result
inconclusive, so a change means a recorded pass or fail that the stop would have cut short),
and writes the counts as a ``pytest-dflash/benchmark/1`` file for ``benchmarks/render.py``:

    python benchmarks/futility_replay.py h200.run*.json cpu-main-job.json \\
        --out benchmarks/results/futility-replay.json --machine "..." --commit "..." \\
        --command "..." --about "..."
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pytest_dflash.evidence import compact
from pytest_dflash.measure.decision import threshold_for
from pytest_dflash.measure.process_statistics import ProcessSample, process_compare
from pytest_dflash.policy.thresholds import Policy


def timing_results(report: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(route, what, measurement) of every cross-process timing result in ``report``."""
    for route, entry in report.get("routes", {}).items():
        for kind, gate in entry.get("gates", {}).items():
            for test in gate.get("tests", []):
                measured = test.get("measurements", {})
                name = test["nodeid"].split("::")[-1]
                for key, item in [("", measured), *measured.get("per_m", {}).items()]:
                    if isinstance(item, dict) and item.get("unit") == "process":
                        yield route, f"{kind} {name} {key}".strip(), item


def replay(item: dict[str, Any], policy: Policy) -> tuple[int, float] | None:
    """(processes, chance) where the stop would have ended ``item``, or None.

    The gate's own sequential decision (``process_compare``) runs again, with the policy's
    futility stop, on the recorded processes in the order the looks took them."""
    recorded = [
        ProcessSample(worker=p["worker"], pid=p["pid"], candidate_s=cand, baseline_s=base,
                      orders=orders, setup_s=p["setup_s"])
        for p in item["processes"] for cand, base, orders in [compact.every_round(p)]
    ]
    taken = [0]

    def sample(count: int, rounds: int) -> list[ProcessSample]:
        del rounds  # what each recorded process timed is what it timed
        out = recorded[taken[0] : taken[0] + count]
        taken[0] += count
        return out

    result = process_compare(
        sample, processes=policy.timing_processes, max_processes=policy.timing_max_processes,
        rounds=policy.timing_min_rounds_per_process, confidence=policy.speed_confidence,
        rule=item["rule"], threshold=threshold_for(item["rule"], policy),
        max_rounds=policy.timing_max_rounds_per_process, futility=policy.timing_futility)
    if result.stopped_futile is None:
        return None
    return len(result.processes), result.stopped_futile


def replay_arguments(doc: str, argv: list[str] | None) -> argparse.Namespace:
    """The command line every replay script takes: reports in, one result file out."""
    parser = argparse.ArgumentParser(description=doc.split("\n", 1)[0])
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    for name in ("machine", "commit", "command", "about"):
        parser.add_argument(f"--{name}", required=True)
    return parser.parse_args(argv)


def write_replay(args: argparse.Namespace, fingerprint: dict[str, Any], *, title: str,
                 columns: list[str], rows: list[list[str]]) -> None:
    """A replay's table as a ``pytest-dflash/benchmark/1`` file (the first report's
    environment, the command line's machine, commit, command and about)."""
    data = {
        "schema": "pytest-dflash/benchmark/1", "kind": "measured", "topic": "timing protocol",
        "title": title, "about": args.about, "machine": args.machine,
        "python": fingerprint["python"], "torch": fingerprint["torch"],
        "cuda": fingerprint.get("cuda"), "commit": args.commit,
        "date": datetime.date.today().isoformat(), "command": args.command,
        "values": {"columns": columns, "rows": rows},
    }
    args.out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = replay_arguments(__doc__, argv)
    policy = Policy()
    total, rows = 0, []
    fingerprint: dict[str, Any] = {}
    for path in args.reports:
        report = json.loads(path.read_text(encoding="utf-8"))
        fingerprint = fingerprint or report["fingerprint"]  # the first report's environment
        for route, what, item in timing_results(report):
            total += 1
            stop = replay(item, policy)
            if stop is not None:
                rows.append([route, what, item["figure"].split(";")[0], item["decision"],
                             f"{stop[0]} of {policy.timing_max_processes}", f"{stop[1]:.3f}",
                             "yes" if item["decision"] != "inconclusive" else "no"])
    write_replay(args, fingerprint,
                 title=f"The futility stop replayed on {total} recorded timing results "
                       f"({len(args.reports)} runs): {len(rows)} stopped early",
                 columns=["route", "timing result", "recorded", "recorded decision",
                          "stop at processes", "chance of a decision at the cap",
                          "decision changed"],
                 rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
