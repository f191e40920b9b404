"""Turn the run reports of ``pytest-dflash selftest --repeat K`` into a result file.

The repeat command writes a report per run (``NAME.runI.json``). This counts pass / inconclusive
/ fail per route, timing gate and planted route over the reports given (several repeat commands'
runs may be pooled: each row says how many runs measured it), with the worst interval the route
itself showed in any run and where the runs were measured (from the last report's evidence
fingerprint), as a ``pytest-dflash/benchmark/1`` file for ``benchmarks/render.py``:

    pytest-dflash selftest cpu.json --repeat 10 --run --dflash-route gemm.nvfp4.qpn2_packed \\
        --dflash-profile ci -k "validation_cost_verify_m or gemm_speed_large_m"
    python benchmarks/timing_aa.py cpu.run*.json --out benchmarks/results/cpu-timing-aa.json \\
        --machine "2-core AMD EPYC CPU, 24 GiB" --commit "$(git rev-parse --short HEAD)" \\
        --command "..." --about "..."
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

LABELS = {"route": "the route itself", "copy": "unchanged copy (A/A)"}


def _label(key: str, kind: str) -> str:
    if key in LABELS:
        return LABELS[key]
    if key.startswith(("slow_", "prefill_slow_", "verify_cost_")):
        slower = key.rsplit("_", 1)[-1].replace("pct", "% slower")
        # speed: the baseline's own code, slowed (no gain); prefill: the baseline's cold
        # prefills, slowed; validation_cost: the verify step
        return {"speed": f"baseline's code, {slower}",
                "prefill": f"baseline's cold prefills, {slower}"}.get(kind,
                                                                       f"verify step {slower}")
    return key


def _order(key: str) -> tuple[int, float]:
    if key == "route":
        return 0, 0.0
    if key == "copy":
        return 1, 0.0
    try:
        return 2, float(key.rsplit("_", 1)[-1].removesuffix("pct"))
    except ValueError:
        return 3, 0.0


def _worst_interval(reports: list[dict[str, Any]], route: str, kind: str) -> str:
    """``route``'s timing figure with the highest CI upper bound over every run."""
    worst: tuple[float, str] | None = None
    for report in reports:
        gate = report["routes"].get(route, {}).get("gates", {}).get(kind, {})
        for test in gate.get("tests", []):
            measured = test.get("measurements", {})
            for m, item in [("", measured), *measured.get("per_m", {}).items()]:
                if "ci_high" in item and (worst is None or item["ci_high"] > worst[0]):
                    worst = (item["ci_high"], f"{m.replace('m', 'M=')} {item['figure']}".strip())
    return worst[1] if worst else "-"


def result_file(reports: list[dict[str, Any]], *, machine: str, commit: str, command: str,
                about: str) -> dict[str, Any]:
    from pytest_dflash.evidence.catch import COPY
    from pytest_dflash.selftest.catalogue import planted_name
    from pytest_dflash.selftest.repeat import tally

    counts = tally(reports)
    rows = []
    for route, kinds in sorted(counts["routes"].items()):
        for kind, keys in sorted(kinds.items()):
            for key in sorted(keys, key=_order):
                c = keys[key]
                name = route if key == "route" else planted_name(route, key)
                worst = _worst_interval(reports, name, kind) if key in ("route", COPY) else "-"
                rows.append([route, kind, _label(key, kind), str(sum(c.values())), str(c["pass"]),
                             str(c["inconclusive"]), str(c["fail"]),
                             str(c["error"] + c["pending"]), worst])
    fingerprint = reports[-1]["fingerprint"]
    return {
        "schema": "pytest-dflash/benchmark/1", "kind": "measured",
        "topic": "timing error rates",
        "title": f"A/A control and planted slowdowns over {counts['runs']} runs "
                 f"({reports[-1]['profile']} profile, {fingerprint['device']})",
        "about": about, "machine": machine, "python": fingerprint["python"],
        "torch": fingerprint["torch"], "cuda": fingerprint.get("cuda"), "commit": commit,
        "date": datetime.date.today().isoformat(), "command": command,
        "values": {"columns": ["route", "gate", "planted", "runs", "pass", "inconclusive",
                               "fail", "other", "widest interval of a run (route, A/A copy)"],
                   "rows": rows},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("reports", type=Path, nargs="+",
                        help="the run reports (NAME.runI.json) of pytest-dflash selftest --repeat")
    parser.add_argument("--out", type=Path, required=True, help="the result file to write")
    parser.add_argument("--machine", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--about", required=True)
    args = parser.parse_args(argv)
    reports = [json.loads(path.read_text(encoding="utf-8")) for path in args.reports]
    data = result_file(reports, machine=args.machine, commit=args.commit,
                       command=args.command, about=args.about)
    args.out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
