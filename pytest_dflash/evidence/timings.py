"""The timing comparisons a test recorded, in either protocol's shape: the one reader of them.

Why: a timing test records its decision in one of two shapes. Timed in the run's worker
processes (``statistics.ProcessResult``, the usual case) each comparison holds ``processes``,
one entry per worker with its rounds' raw ``samples`` and its statistic; timed in the test's own
process (``statistics.PairedResult``) it holds the rounds' ``samples`` at its top. A
validation_cost test nests one comparison per verify width under ``per_m``. The plot, the JUnit
properties, ``diff`` and the catch table all read comparisons through this module, so a change
of shape is fixed in one place and cannot leave one reader looking for a field that is gone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard

PROCESS, ROUND = "process", "round"


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value)


def _pair(samples: Any) -> bool:
    return (isinstance(samples, Mapping) and isinstance(samples.get("candidate"), list)
            and isinstance(samples.get("baseline"), list))


def protocol(series: Mapping[str, Any]) -> str | None:
    """``process`` (timed across worker processes), ``round`` (rounds in the test's process), or
    None for a mapping that is not a timing comparison."""
    if not _number(series.get("threshold")):
        return None
    procs = series.get("processes")
    if isinstance(procs, list) and procs and all(isinstance(p, Mapping) for p in procs):
        return PROCESS
    if _pair(series.get("samples")):
        return ROUND
    return None


def comparisons(measurements: Mapping[str, Any], prefix: str = ""
                ) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every timing comparison in a test's measurements, with a label for it.

    At the top for speed tests; nested for validation_cost (``per_m`` -> ``m1``.. ``m8``, each
    labelled ``verify M=1``..). A process entry's own ``samples`` are not comparisons.
    """
    if protocol(measurements) is not None:
        width = re.fullmatch(r"per_m m(\d+)", prefix)
        tokens = measurements.get("prompt_tokens")
        label = (f"verify M={width.group(1)}" if width else prefix) or measurements.get(
            "shape") or (f"prompt of {tokens} tokens" if tokens else "timing")
        yield str(label), measurements
    for key, value in measurements.items():
        if isinstance(value, Mapping) and key not in ("samples", "variance"):
            yield from comparisons(value, f"{prefix} {key}".strip())


def ratios(samples: Mapping[str, Any]) -> list[float]:
    """candidate / baseline per round of a ``samples`` pair (rounds with a zero baseline and
    non-numeric entries are left out)."""
    cand, base = samples.get("candidate") or [], samples.get("baseline") or []
    return [c / b for c, b in zip(cand, base, strict=False) if _number(c) and _number(b) and b]


def processes(series: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per worker process of a process-protocol comparison: its index, worker, ratio (the
    process statistic, exponentiated), the ratios of the rounds the report keeps, and the
    quartiles (q1, q3) of every round's ratio where the report has its summary
    (``evidence.compact``). Empty for the round protocol."""
    if protocol(series) != PROCESS:
        return []
    out = []
    for index, proc in enumerate(series["processes"], start=1):
        rounds = ratios(proc.get("samples") or {})
        ratio = proc.get("ratio")
        if not _number(ratio) and _number(proc.get("statistic")):
            ratio = math.exp(proc["statistic"])
        summary = (proc.get("summary") or {}).get("ratio") or {}
        quartiles = ((float(summary["q1"]), float(summary["q3"]))
                     if _number(summary.get("q1")) and _number(summary.get("q3")) else None)
        out.append({"index": index, "worker": proc.get("worker"), "pid": proc.get("pid"),
                    "ratio": float(ratio) if _number(ratio) else None, "rounds": rounds,
                    "quartiles": quartiles})
    return out


def units(series: Mapping[str, Any]) -> int:
    """How many independent units the comparison's interval rests on: processes for the
    process protocol (the interval is computed across them), rounds for the round protocol."""
    if protocol(series) == PROCESS:
        return len(series["processes"])
    rounds = series.get("rounds")
    if _number(rounds):
        return int(rounds)
    return len(ratios(series.get("samples") or {}))


def interval(series: Mapping[str, Any]) -> tuple[float, float] | None:
    """The recorded interval (ci_low, ci_high) of the ratio, None if it is not recorded."""
    low, high = series.get("ci_low"), series.get("ci_high")
    if _number(low) and _number(high):
        return float(low), float(high)
    return None


def worst(measurements: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The comparison closest to failing: the highest interval upper bound. The top-level
    record when it carries an interval itself (a speed test), else the worst nested one."""
    if interval(measurements) is not None:
        return measurements
    found = [s for _, s in comparisons(measurements) if interval(s) is not None]
    return max(found, key=lambda s: s["ci_high"]) if found else None
